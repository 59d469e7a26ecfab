"""The trainer's loop around rejected updates: nothing published, the learning rate backed
off and recovering (the update itself stubbed; tests/trainer/test_trainer_cells.py runs the
trainer against real training ranks)."""

from __future__ import annotations

import torch

from cells.trainer.trainer import Trainer
from scheduler.contract.config import parse_config

torch.set_num_threads(1)


class FakeClient:
    """The REST client as the trainer's checkpoint, resume and publish use it."""

    def __init__(self, known_versions: list[int]) -> None:
        self.cursor = 0
        self.known = list(known_versions)
        self.published: list[int] = []

    def cells(self) -> list[dict]:
        return [{"id": "cell-0", "state": "training"}]

    def register_version_host(self, host: str, port: int) -> dict:
        return {}

    def flips(self, active: bool = False) -> list[dict]:
        return []

    def report_training(self, **kw) -> dict:
        return {"auto_flip": False}

    def versions(self) -> dict:
        return {"versions": [{"version": v, "state": "active"} for v in self.known]}

    def publish(self, version: int, host: str, port: int, namespace: str) -> dict:
        self.published.append(version)
        self.known.append(version)
        return {"version": version, "receivers": [], "receiver_ranks": {}}

    def close(self) -> None:
        pass


def _trainer(tmp_path, name: str, client: FakeClient) -> Trainer:
    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": {"preset": "toy"}}},
                        "trainer": {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "seed": 3}})
    t = Trainer(cfg, "http://127.0.0.1:9", run_dir=tmp_path / name)
    t.client = client
    return t


class _Cells:
    """The step's cells, as `_step` uses them (no flips: the update itself is stubbed)."""

    planner_flips = 0

    def acquire(self, untrained: int) -> list[str]:
        return ["cell-0"]

    def group(self) -> list[str]:
        return ["cell-0"]

    def release(self, cells) -> None:
        pass

    def declare(self, *a, **k) -> None:
        pass

    def finished_flips(self) -> list[dict]:
        return []


def test_a_rejected_update_publishes_nothing_and_backs_the_learning_rate_off(tmp_path):
    import threading

    client = FakeClient([0])
    client.trajectories = lambda limit=64: []
    client.wait_scored = lambda batch, timeout_s=600: batch
    client.report_dropped = lambda *a: None
    t = _trainer(tmp_path, "r", client)
    t.tc = t.tc.model_copy(update={"lr": 1e-3})
    t._set_lr_scale(1.0)
    t.cells = _Cells()
    t.versions_published = 0
    def batch(n: int) -> list[dict]:
        return [{"id": f"s{i}", "reward": 1.0, "group_id": f"g{i}", "loss_mask": [0, 1],
                 "provenance": [None, "exact"], "token_ids": [1, 2], "versions": [None, 0]} for i in range(n)]

    t._complete_groups = batch
    outcomes = iter([{"update_rejected": 1.0, "update_kl": 3.0}, {"update_rejected": 1.0, "update_kl": 2.0},
                     {"update_rejected": 0.0, "update_kl": 0.1}])
    t.coordinator.update = lambda batch, cells, **kw: dict(next(outcomes))
    t._publish = lambda: client.publish(t._next_version(), "h", 0, "ns")
    stop = threading.Event()
    t._step(stop)
    assert client.published == [] and t.updates_rejected == 1 and t.versions_published == 0
    assert t.coordinator.lr == 1e-3 * t.tc.reject_lr_backoff  # the next update takes a smaller step
    t._step(stop)
    assert client.published == [] and t.coordinator.lr == 1e-3 * t.tc.reject_lr_backoff ** 2
    t._step(stop)  # kept: published, and the rate recovers (never past the configured one)
    assert client.published == [1] and t.updates_kept == t.versions_published == 1
    assert t.coordinator.lr == min(1e-3, 1e-3 * t.tc.reject_lr_backoff ** 2 * t.tc.reject_lr_recovery)
    t.store.close()

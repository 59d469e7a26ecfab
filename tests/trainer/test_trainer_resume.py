"""The trainer's checkpoint and resume: RL step, data cursor, learner state (parameters,
optimizer, RNG) and a version number newer than any the scheduler has seen; the checkpoint is
safetensors plus a JSON manifest (no pickle)."""

from __future__ import annotations

import torch

from cells.trainer.trainer import CHECKPOINT, Trainer
from cells.transport.broadcast import BroadcastResult
from scheduler.contract.config import parse_config

torch.set_num_threads(1)


class FakeClient:
    """The REST client as the trainer's checkpoint, resume and publish use it."""

    def __init__(self, known_versions: list[int]) -> None:
        self.cursor = 0
        self.known = list(known_versions)
        self.published: list[int] = []

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
    t.host.broadcast = lambda version, receivers, ranks=None: BroadcastResult(version)
    return t


def _demo(t: Trainer) -> list[tuple[list[int], list[int]]]:
    ids = list(t.spec.output_ids()[:5])
    return [(ids, [0, 0, 1, 1, 1])]


def test_checkpoint_then_resume_restores_step_cursor_learner_and_publishes_a_newer_version(tmp_path):
    first = _trainer(tmp_path, "a", FakeClient([0, 1, 2, 3, 4, 5]))
    first.learner.sft_step(_demo(first))  # moves parameters and optimizer state
    torch.randint(10, (3,), generator=first.learner.generator)
    first.learner.version, first.rl_step, first.client.cursor = 5, 3, 17
    first._checkpoint()
    first.flush()
    (latest,) = [p for p in (tmp_path / "ckpt" / CHECKPOINT).iterdir() if p.is_dir()]
    assert sorted(p.name for p in latest.iterdir()) == ["manifest.json", "state.safetensors"]  # no pickle
    first.host.close()

    second = _trainer(tmp_path, "b", FakeClient([0, 1, 2, 3, 4, 5]))
    assert not all(torch.equal(second.learner.params[k], first.learner.params[k]) for k in first.learner.params)
    assert second._resume() is True
    assert (second.rl_step, second.client.cursor, second.learner.cursor) == (3, 17, 17)
    # cells may hold anything after a restart: the resumed weights go out as a version the
    # scheduler has never seen, never as a reused number
    assert second.client.published == [6] and second.learner.version == 6
    for k in first.learner.params:
        assert torch.equal(second.learner.params[k].detach(), first.learner.params[k].detach())
    assert torch.equal(torch.randint(1000, (4,), generator=second.learner.generator),
                       torch.randint(1000, (4,), generator=first.learner.generator))
    a, b = first.learner.sft_step(_demo(first)), second.learner.sft_step(_demo(second))
    assert a["loss"] == b["loss"]  # the same optimizer state: the same next step
    for k in first.learner.params:
        assert torch.equal(second.learner.params[k].detach(), first.learner.params[k].detach())
    second.host.close()


def test_without_a_checkpoint_there_is_nothing_to_resume(tmp_path):
    t = _trainer(tmp_path, "a", FakeClient([]))
    assert t._resume() is False and t.rl_step == 0 and t.client.published == []
    t.host.close()


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
    stop = threading.Event()
    t._step(stop)
    assert client.published == [] and t.updates_rejected == 1 and t.versions_published == 0
    assert t.learner.lr == 1e-3 * t.tc.reject_lr_backoff  # the next update takes a smaller step
    t._step(stop)
    assert client.published == [] and t.learner.lr == 1e-3 * t.tc.reject_lr_backoff ** 2
    t._step(stop)  # kept: published, and the rate recovers (never past the configured one)
    assert client.published == [1] and t.updates_kept == t.versions_published == 1
    assert t.learner.lr == min(1e-3, 1e-3 * t.tc.reject_lr_backoff ** 2 * t.tc.reject_lr_recovery)
    t.host.close()

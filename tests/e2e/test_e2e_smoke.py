"""The main job in miniature: scheduler + cells + the trainer and its agents on the toy task,
a few RL steps. At least one flip with a live migration, no lost rollout, every trained token
with an exact old log-prob, versions retired only once scored, tree rollouts in the batches.
The training cells compute the updates: the trainer ran no forward or backward in RL steps,
at least one step trained on two cells, and a cell that trained installs the new version
locally when it flips back (no broadcast to itself)."""

import json

import pytest

from cells.localcluster import Cluster
from cells.trainer.trainer import Trainer
from scheduler.contract.config import parse_config

pytestmark = pytest.mark.slow


def _cfg(tmp, steps=2):
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 10.0, "heartbeat_s": 0.25,
                      "min_rollout_cells": 1, "drain_deadline_s": 60.0},
        "cells": {"count": 3, "engine": {"type": "embedded", "model": {"preset": "toy"}, "num_blocks": 512,
                                         "block_size": 16, "max_running": 8, "batch_invariant": True}},
        "migration": {"transfer_timeout_s": 20.0},
        "gateway": {"renderer": "qwen3-nothink"},
        "trainer": {"enabled": True, "steps": steps, "seed": 3, "warmup_steps": 30, "batch_episodes": 8,
                    "agents": 12, "group_size": 2, "train_cells": 2, "branch_fraction": 0.5, "train_cell_choice": "busiest", "long_fraction": 0.3,
                    "checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 1},
    }


def test_rl_steps_flip_migrate_score_and_retire(tmp_path):
    raw = _cfg(tmp_path)
    c = Cluster(tmp_path, num_cells=3, cfg=raw, ready_timeout_s=300)
    try:
        trainer = Trainer(parse_config(raw), c.url, run_dir=tmp_path, tag="smoke", token=c.trainer_token, agent_token=c.agent_token)
        summary = trainer.run()
        assert summary["steps"] == 2, summary
        assert summary["flips"] >= 2 and summary["lost_rollouts"] == 0, summary
        assert summary["exact_frac"] == 1.0, summary
        steps = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
        steps = [s for s in steps if s["event"] == "step"]
        assert sum(s["migrated"] for s in steps) + sum(s["suspended"] for s in steps) >= 1, steps
        assert all(s["missing"] == 0 for s in steps)
        versions = c.http.get("/v1/versions").json()["versions"]
        numbers = [v["version"] for v in versions]
        # the warm-up's version, then one per kept update (a rejected one publishes nothing)
        assert summary["updates_kept"] + summary["updates_rejected"] == 2, summary
        assert len(numbers) == 1 + summary["updates_kept"] == 1 + summary["versions_published"], (numbers, summary)
        assert numbers == sorted(numbers)
        for v in versions:
            if v["state"] == "retired":
                assert v["tokens_unscored"] == 0 and v["tokens_scored"] + v["tokens_missing"] == v["tokens_generated"]
        assert (tmp_path / "ckpt" / "trainer-state" / "LATEST").exists()  # safetensors + JSON, named by LATEST
        # the trainer computed nothing, the warm-up included; every version came from a cell
        assert summary["trainer_compute_s"] == 0.0 and summary["max_train_cells"] >= 2, summary
        assert all(s["trainer_compute_s"] == 0.0 and s["train_cells"] >= 1 for s in steps), steps
        events = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
        published = [e for e in events if e["event"] == "published"]
        assert len(published) == len(numbers) and all(e["root"] == "cell" for e in published), published
        cell_logs = "".join(f.read_text() for f in tmp_path.glob("cell-*.log"))
        assert "(local), installed" in cell_logs, "no cell installed a version it computed"
    finally:
        c.stop()

"""The trainer against a real training rank (a bare rank process, no engine) and a fake REST
client: it starts from the user's Hugging Face weights on the cell (no warm-up, the start
checksum those weights'), publishes from the cell, has the cell checkpoint the state, and a
restarted trainer resumes at the commit the cell still holds -- all without one byte of
model state through its own process, and without computing anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.trainer.figures import trainer_compute_s, trainer_state_bytes
from cells.trainer.trainer import CHECKPOINT, Trainer
from cells.training import state_files
from cells.training.protocol import alive_key
from cells.training.wire import params_view, weights_checksum
from cells.transport.store import wait_keys
from scheduler.contract.config import parse_config
from tests.trainer.test_trainer_resume import FakeClient
from tests.training.cluster import ROOT

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _trainer(tmp_path, model: dict, client: FakeClient, **trainer) -> Trainer:
    cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": model}},
                        "trainer": {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "seed": 3,
                                    "train_cells": 0, "resume_wait_s": 5, **trainer}})
    t = Trainer(cfg, "http://127.0.0.1:9", run_dir=tmp_path / "run")
    t.client = t.cells.client = client
    return t


def _rank(tmp_path, t: Trainer) -> subprocess.Popen:
    a = t.store.address
    log = open(tmp_path / "cell-0.log", "a")
    p = subprocess.Popen([sys.executable, "-m", "cells.training.bare", "--store", f"{a.host}:{a.port}",
                          "--cell-id", "cell-0"], env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                         stdout=log, stderr=subprocess.STDOUT)
    assert wait_keys(t.coordinator.store, [alive_key("cell-0")], 120), (tmp_path / "cell-0.log").read_text()
    return p


def test_a_user_model_starts_on_the_cell_checkpoints_there_and_resumes_from_it(tmp_path):
    spec = PRESETS["tiny"] if "tiny" in PRESETS else PRESETS["toy"]
    theirs = init_weights(spec, seed=11, std=0.05)
    src = save_checkpoint(tmp_path / "their-model", spec, theirs)
    client = FakeClient([0])
    compute0, bytes0 = trainer_compute_s(), trainer_state_bytes()  # this process's, so far
    t = _trainer(tmp_path, {"preset": None, "path": str(src)}, client)
    proc = _rank(tmp_path, t)
    try:
        assert t.warmup_steps == 0
        t._start()  # built on the cell from their weights, RL begun, published from the cell
        events = [e for e in map(__import__("json").loads, (tmp_path / "run" / "trainer.jsonl").read_text().splitlines())]
        model = next(e for e in events if e["event"] == "model")
        assert model["checksum"] == weights_checksum(theirs) and model["cell"] == "cell-0"
        assert model["checksum"] != weights_checksum(init_weights(spec, seed=12, std=0.05))  # negative control
        published = [e for e in events if e["event"] == "published"]
        assert client.published == [1] and published[0]["root"] == "cell"
        t.rl_step, t.client.cursor = 4, 17
        t.coordinator.commit["extra"] = t._extra()
        t._checkpoint()
        t.flush()
        meta, flat, _ = state_files.load_packed(tmp_path / "ckpt" / CHECKPOINT)
        assert all(torch.equal(v, theirs[k]) for k, v in params_view(meta, flat).items())
        (latest,) = [p for p in (tmp_path / "ckpt" / CHECKPOINT).iterdir() if p.is_dir()]
        assert sorted(p.name for p in latest.iterdir()) == ["manifest.json", "state.safetensors"]  # no pickle
        t.store.close()
        # restarted: the cell reconnects to the same address and announces the commit it holds
        again = _trainer(tmp_path, {"preset": None, "path": str(src)}, client)
        assert again.store.address.port == t.store.address.port
        assert again._resume() is True
        assert (again.version, again.rl_step) == (1, 0) and again.coordinator.holders == ["cell-0"]
        assert again.coordinator.checkpoint_path is None or again.coordinator.checkpoint_path.endswith(CHECKPOINT)
        again.store.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert trainer_compute_s() == compute0 and trainer_state_bytes() == bytes0  # none of it here

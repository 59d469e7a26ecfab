"""The training coordinator SIGKILLed mid-step while the cells train, then restarted from its
checkpoint: training resumes at the last published version, no version is taken twice, and
no cell keeps the half-committed update (both rejoin with the restarted coordinator's state)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.training.cluster import ROOT, Ranks, learner, rel_diff, trajectories

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _coordinator(ranks: Ranks, tmp, checkpoint, env: dict) -> subprocess.CompletedProcess:
    a = ranks.host.address
    cmd = [sys.executable, "-m", "tests.training.coordinator_proc", "--store", f"{a.host}:{a.port}",
           "--checkpoint", str(checkpoint), "--out", str(tmp), "--cells", "cell-0,cell-1"]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=240)


def test_a_coordinator_sigkilled_mid_step_resumes_from_its_checkpoint(tmp_path):
    base = learner()
    clean = learner()
    clean.rl_step(trajectories(base, seed=5))  # the fault-free step on the same batch
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(learner().state_dict(), checkpoint)  # the last checkpoint: version 0, before the step
    ranks = Ranks(tmp_path, 2)
    try:
        killed = _coordinator(ranks, tmp_path, checkpoint, {"CELLFLIP_FAILPOINTS": "training.before_commit=kill"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert not (tmp_path / "published.jsonl").exists()  # it died holding the update, uncommitted
        restarted = _coordinator(ranks, tmp_path, checkpoint, {})
        assert restarted.returncode == 0, restarted.stderr[-3000:]
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    taken = [json.loads(x)["version"] for x in (tmp_path / "published.jsonl").read_text().splitlines()]
    m = json.loads((tmp_path / "result.json").read_text())["metrics"]
    assert taken == [1] and m["version"] == 1.0  # one version, from the restarted coordinator
    assert m["attempts"] == 1.0 and m["join_cells"] == 2.0  # both cells dropped the uncommitted update
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    theta0 = {k: p.detach().clone() for k, p in base.params.items()}
    d = rel_diff({k: p.detach() for k, p in clean.params.items()}, params, theta0)
    assert d <= 1e-3, d

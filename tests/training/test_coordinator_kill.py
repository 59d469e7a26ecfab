"""The trainer SIGKILLed between a commit and the end of its checkpoint loses no committed
version: restarted, it resumes at the newest commit the cells hold (newer than its
checkpoint), takes no version twice, sends no state (the ranks hold it), and ends bitwise
where an uninterrupted run on the same cells ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.training.cluster import ROOT, Ranks, committed_params, coordinator, learner, trajectories

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _coordinator(ranks: Ranks, out, checkpoint, steps: int, env: dict) -> subprocess.CompletedProcess:
    a = ranks.host.address
    cmd = [sys.executable, "-m", "tests.training.coordinator_proc", "--store", f"{a.host}:{a.port}",
           "--checkpoint", str(checkpoint), "--out", str(out), "--cells", "cell-0,cell-1", "--steps", str(steps)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=240)


def test_a_trainer_killed_between_commit_and_checkpoint_resumes_at_the_cells_newest_commit(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    ranks = Ranks(tmp_path, 2)
    try:
        killed = _coordinator(ranks, out, tmp_path / "ckpt", 3, {"CELLFLIP_FAILPOINTS": "training.after_commit=2*kill"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        restarted = _coordinator(ranks, out, tmp_path / "ckpt", 3, {})
        assert restarted.returncode == 0, restarted.stderr[-3000:]
        # the uninterrupted run on the same ranks (they build the start state again)
        coord = coordinator(learner(), ranks.host.address)
        for s in range(3):
            coord.update(trajectories(learner(), seed=s), ["cell-0", "cell-1"], next_version=lambda: coord.version + 1)
        clean = committed_params(coord, tmp_path / "clean")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    committed = [json.loads(x)["version"] for x in (out / "committed.jsonl").read_text().splitlines()]
    r = json.loads((out / "result.json").read_text())
    assert committed == [1, 2, 3]  # version 2 survived on the cells although its checkpoint never was written
    assert r["resumed"] == 2 and r["from_cells"]
    assert [m["join_cells"] for m in r["metrics"]] == [0.0]  # the ranks held it: nothing sent
    params = torch.load(out / "params.pt", weights_only=True)
    assert all(torch.equal(params[k], clean[k]) for k in clean)
    # negative control: the start weights differ from where the runs ended
    assert not all(torch.equal(learner().params[k].detach(), clean[k]) for k in clean)

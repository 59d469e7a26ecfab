"""Cells of S training ranks (`cells.train_ranks`) in the cell system: bare cells of 2 ranks each
(rank 0 starts rank 1) around an in-process coordinator. Two cells × two ranks train three
updates on a 1:2 token split equal to one process's updates; a cell joining mid-run takes its
slices from the same-index ranks of a cell of the step; the state written as one shard per rank
is read back by a fresh cell of 3 ranks (re-sharded) that continues to the one-process result."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from cells.rl.sft import begin_rl, sft_steps
from cells.training import shard_files, state_files
from tests.training.cluster import Ranks, coordinator, learner, rel_diff, trajectories

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _params(lrn) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in lrn.params.items()}


def _checkpoint(coord, path) -> dict[str, torch.Tensor]:
    r = coord.checkpoint_done(coord.checkpoint(str(path)), str(path), 120)
    assert r.get("ok"), r
    return shard_files.load_params(str(path), {k: s for k, s in coord.params})


def _wait_gone(ranks: Ranks, cells: list[str], timeout_s: float = 20.0) -> None:
    """The cells' rank 0 killed: their rank 1 exits by itself (it watches its parent)."""
    for c in cells:
        ranks.procs[c].kill()
        ranks.procs[c].wait(timeout=10)
    time.sleep(min(timeout_s, 2.0))


def _demos(n: int = 6) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(n):
        ids = [8000] + [(7 * i + j) % 48 for j in range(5 + i % 4)] + [8001]
        out.append((ids, [0, 0] + [1] * (len(ids) - 2)))
    return out


@pytest.mark.timeout(420)
def test_two_cells_of_two_ranks_train_join_checkpoint_and_reshard_like_one_process(tmp_path):
    base = learner(max_grad_norm=1.0)
    theta0 = _params(base)
    batches = [trajectories(base, seed=s) for s in range(4)]
    clean, steps = learner(max_grad_norm=1.0), []
    sft_steps(clean, _demos(), steps=3, batch_size=2)
    begin_rl(clean)
    steps.append(_params(clean))
    for b in batches:
        clean.rl_step(b)
        steps.append(_params(clean))
    ranks = Ranks(tmp_path, 0)
    for c in ("cell-0", "cell-1"):
        ranks.start(c, args=["--ranks", "2"])
    ranks.wait_ready(["cell-0", "cell-1"])
    try:
        coord = coordinator(learner(max_grad_norm=1.0), ranks.host.address)
        v = lambda: coord.version + 1  # noqa: E731
        # the supervised warm-up on cell-0, each of its ranks building its slices first
        m0 = coord.warmup("cell-0", _demos(), steps=3, batch_size=2, lr=clean.lr)
        warm = _checkpoint(coord, tmp_path / "ckpt0")
        ms = [coord.update(b, ["cell-0", "cell-1"], shares=[1.0, 2.0], next_version=v) for b in batches[:3]]
        three = _checkpoint(coord, tmp_path / "ckpt")
        _wait_gone(ranks, ["cell-0", "cell-1"])
        coord.holders = []  # no cell holds the state now: the checkpoint is its home
        ranks.start("cell-2", args=["--ranks", "3"])
        ranks.wait_ready(["cell-2"])
        ms.append(coord.update(batches[3], ["cell-2"], next_version=v))
        four = _checkpoint(coord, tmp_path / "ckpt2")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert m0["join_source"] == "build" and m0["version"] == 1.0
    assert [m["join_source"] for m in ms] == ["rank", "none", "none", "checkpoint"]  # cell-1 joins
    assert [m["join_cells"] for m in ms] == [1.0, 0.0, 0.0, 1.0]
    assert [m["version"] for m in ms] == [2.0, 3.0, 4.0, 5.0]
    assert all(m["attempts"] == 1.0 for m in ms)
    d = {"warm-up": rel_diff(steps[0], warm, theta0), "2x2": rel_diff(steps[3], three, theta0),
         "3 ranks": rel_diff(steps[4], four, theta0), "control": rel_diff(steps[2], three, theta0)}
    print("param_max_rel_diff", d)
    # the warm-up on 2 ranks (rank 0's gradient counts) equals one process's
    assert d["warm-up"] <= 1e-4 and rel_diff(theta0, warm, steps[0]) > 0.5
    # the 2 x 2 updates equal one process's (float order of the sums); the negative control:
    # one update fewer is far from it, so the comparison sees a missing or wrong update
    assert d["2x2"] <= 1e-4 and d["control"] > 1e-2
    # re-sharded from 2 to 3 ranks, one more update: still the one-process run
    assert d["3 ranks"] <= 1e-4 and rel_diff(steps[3], four, theta0) > 1e-2
    log = (tmp_path / "cell-1.log").read_text()
    assert "slice of" in log and "from rank 1" in log  # cell-1's rank took its slice from cell-0's


@pytest.mark.timeout(300)
def test_a_cell_of_two_gathered_ranks_warms_up_trains_checkpoints_and_publishes_like_one_process(tmp_path):
    """`trainer.shard_layout: gathered` through the cells' training worker: rank 0 and the rank
    it starts build `GatheredLearner`s (no compute copy), warm up on the same demonstrations,
    train an update, write a shard per rank, and rank 0 publishes the version it gathered."""
    from cells.engine.embedded.checkpoint import load_checkpoint
    from cells.training import jobs
    from cells.training.protocol import spec_from_signature

    base = learner(max_grad_norm=1.0)
    theta0 = _params(base)
    batch = trajectories(base, seed=3)
    clean = learner(max_grad_norm=1.0)
    sft_steps(clean, _demos(), steps=2, batch_size=2)
    begin_rl(clean)
    warm = _params(clean)
    clean.rl_step(batch)
    ranks = Ranks(tmp_path, 0)
    ranks.start("cell-0", args=["--ranks", "2"])
    ranks.wait_ready(["cell-0"])
    try:
        lrn = learner(max_grad_norm=1.0)
        lrn.shard_layout = "gathered"
        coord = coordinator(lrn, ranks.host.address)
        coord.warmup("cell-0", _demos(), steps=2, batch_size=2, lr=clean.lr)
        m = coord.update(batch, ["cell-0"], next_version=lambda: coord.version + 1)
        got = _checkpoint(coord, tmp_path / "ckpt")
        out = tmp_path / "export"
        r = jobs.wait(coord.store, jobs.post(coord.store, "cell-0", {"op": "export", "version": coord.version,
                                                                      "path": str(out)}), 60)
        assert r.get("ok"), r
        exported = load_checkpoint(out, spec_from_signature(coord.hyper["model"]))
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    log = (tmp_path / "cell-0.log").read_text()
    assert log.count("warmup on GatheredLearner") == 2 and log.count("rl on GatheredLearner") == 2
    assert m["version"] == 2.0 and m["attempts"] == 1.0
    d = rel_diff(_params(clean), got, theta0)
    print("gathered cell of 2 ranks vs one process:", d)
    assert d <= 1e-4
    assert rel_diff(_params(clean), warm, theta0) > 1e-2  # negative control: the update is seen
    # what rank 0 publishes (gathered from the slices) is the committed state, bitwise
    assert all(torch.equal(exported[k], got[k]) for k in got)
    assert not all(torch.equal(exported[k], warm[k]) for k in got)  # negative control


def test_a_one_rank_cell_refuses_a_sharded_checkpoint_clearly(tmp_path):
    shard_files.write_index(str(tmp_path), "shards-x", 2, {"tag": "t"})
    with pytest.raises(state_files.StateFileError, match="sharded over 2 training ranks"):
        state_files.load_packed(tmp_path)


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of the cell rank `rank` that the rank 0 `parent` started."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"cells.training.cell_ranks" in cmd and cmd[cmd.index(b"--parent") + 1] == str(parent).encode() \
                    and cmd[cmd.index(b"--cell-rank") + 1] == str(rank).encode():
                return int(d.name)
    raise LookupError(f"no rank {rank} of {parent}")


@pytest.mark.timeout(420)
def test_a_rank_dying_or_stopped_and_a_parked_peer_serving_slices(tmp_path):
    base = learner(max_grad_norm=1.0)
    theta0 = _params(base)
    batches = [trajectories(base, seed=s) for s in (6, 7, 8, 9)]
    clean, steps = learner(max_grad_norm=1.0), []
    for b in batches:
        clean.rl_step(b)
        steps.append(_params(clean))
    # cell-1's rank 1 alone dies after the second update's first minibatch
    env = {1: {"CELLFLIP_FAILPOINTS_RANK_1": "training.after_minibatch=3*kill"}}
    ranks = Ranks(tmp_path, 0)
    for i in range(3):
        ranks.start(f"cell-{i}", env.get(i), ["--ranks", "2"])
    ranks.wait_ready(["cell-0", "cell-1", "cell-2"])
    stopped = None
    try:
        coord = coordinator(learner(max_grad_norm=1.0), ranks.host.address, timeout_s=15, ack_timeout_s=30)
        v = lambda: coord.version + 1  # noqa: E731
        m1 = coord.update(batches[0], ["cell-0", "cell-1"], next_version=v)
        m2 = coord.update(batches[1], ["cell-0", "cell-1"], next_version=v)
        # cell-2 trains alone: the state's slices come from the ranks of cell-0, outside the step
        m3 = coord.update(batches[2], ["cell-2"], next_version=v, peers=["cell-0"])
        # cell-0's rank 1 stopped: cell-0 does not ack, the step goes on without it
        stopped = _rank_pid(ranks.procs["cell-0"].pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        coord.ack_timeout_s = 4.0
        m4 = coord.update(batches[3], ["cell-2", "cell-0"], next_version=v)
        final = _checkpoint(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
        if stopped is not None:  # rank 0 killed it already, or it is ours to end (the same process)
            with contextlib.suppress(OSError):
                if b"cells.training.cell_ranks" in Path(f"/proc/{stopped}/cmdline").read_bytes():
                    os.kill(stopped, signal.SIGKILL)
    assert m1["attempts"] == 1.0 and m1["join_source"] == "build"
    # the failed attempt: cell-0 restored its slices (the compute copy gathered at the redo),
    # cell-1's rank 0 restarted its rank 1, which holds nothing: cell-1 joined from cell-0
    assert m2["attempts"] == 2.0 and m2["cells_lost"] == 0.0 and m2["train_cells"] == 2.0
    assert m2["join_source"] == "rank" and m2["join_cells"] == 1.0
    assert "restored the start-of-update state" in (tmp_path / "cell-0.log").read_text()
    assert m3["join_source"] == "peer" and m3["version"] == 3.0
    assert m4["attempts"] == 2.0 and m4["cells_lost"] == 1.0 and m4["train_cells"] == 1.0
    assert [m["version"] for m in (m1, m2, m4)] == [1.0, 2.0, 4.0]
    assert rel_diff(steps[3], final, theta0) <= 1e-4
    assert rel_diff(steps[2], final, theta0) > 1e-2


def test_cells_train_ranks_reaches_the_cells_training_worker_and_defaults_to_one():
    from cells.agent import CellAgent
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.contract.config import ConfigError, parse_config

    def agent(extra: dict) -> CellAgent:
        cfg = parse_config({"cells": {"engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 64,
                                                 "block_size": 16}, **extra}})
        return CellAgent(cfg, cell_id="c-test", scheduler_url="http://127.0.0.1:9",
                         engine=EmbeddedEngine(cfg.cells.engine))

    for extra, size in (({}, 1), ({"train_ranks": 2}, 2)):
        a = agent(extra)
        try:
            assert (a.training.cell_rank, a.training.cell_size) == (0, size)
            assert a.training.followers is None  # started only once a coordinator's store is known
        finally:
            a.client.close()
            a.versions.close()
            a.store_host.close()
    with pytest.raises(ConfigError, match="train_ranks"):
        parse_config({"cells": {"train_ranks": 0}})


def test_a_cell_rank_whose_rank_0_is_gone_exits_by_itself():
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cells.training.cell_ranks", "--store", "127.0.0.1:9", "--cell-id", "c",
                        "--cell-rank", "1", "--cell-ranks", "2", "--parent", str(gone.pid)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "rank 0 is gone" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60

"""Elastic membership and faults, with bare training ranks in their own processes and a
coordinator that holds no state: a cell joins between steps (its state from a rank of the
step) and another leaves; a step whose ranks hold nothing current takes the state from a
peer that holds it parked; a rank SIGKILLed or stalled in the middle of an update leaves the
survivors to restore the start-of-update state they hold and redo the step without any
transfer; the only training rank dying leaves the state on a peer; a coordinator dying
before its commit is redone by its restart. Every run ends with the fault-free parameters."""

from __future__ import annotations

import json

import pytest
import torch

from cells.training.bare import reply_key, request_key
from cells.training.coordinator import StepFailed
from cells.transport.store import set_json, wait_json
from tests.training.cluster import (
    Ranks,
    committed_params,
    coordinator,
    learner,
    rel_diff,
    trajectories,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _params(lrn) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in lrn.params.items()}


def test_cells_join_leave_and_take_the_state_from_a_rank_or_a_parked_peer(tmp_path):
    lrn = learner()
    batches = [trajectories(lrn, seed=s) for s in range(5)]
    clean = learner()
    for b in batches:
        clean.rl_step(b)
    ranks = Ranks(tmp_path, 3)
    failed: list[dict] = []  # a redone attempt's reason, for the assertion below
    try:
        coord = coordinator(lrn, ranks.host.address, emit=lambda rec: failed.append(rec)
                            if rec.get("event") == "train_attempt_failed" else None)
        v = lambda: coord.version + 1  # noqa: E731
        m1 = coord.update(batches[0], ["cell-0", "cell-1"], next_version=v)
        pids = {c: p.pid for c, p in ranks.procs.items()}
        m2 = coord.update(batches[1], ["cell-0", "cell-1", "cell-2"], next_version=v)  # cell-2 joins
        m3 = coord.update(batches[2], ["cell-1", "cell-2"], next_version=v)  # cell-0 left
        # cell-1 flips out of the training role and back (a rollout stint with no step in it):
        # it keeps its state, still the committed one, and needs nothing at the next step
        set_json(coord.store, request_key("cell-1", 1), {"op": "flip"})
        assert wait_json(coord.store, reply_key("cell-1", 1), 30) == {"mode": "flip"}
        # cell-0 comes back holding step 2's state: the current one from cell-1, in place
        m4 = coord.update(batches[3], ["cell-0", "cell-1"], next_version=v)
        # cell-2 alone holds step 3's state; cell-0 and cell-1 hold step 4's: a peer serves it
        m5 = coord.update(batches[4], ["cell-2"], next_version=v, peers=["cell-0", "cell-1"])
        final = committed_params(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert {c: p.pid for c, p in ranks.procs.items()} == pids  # nobody restarted
    ms = (m1, m2, m3, m4, m5)
    assert [m["train_cells"] for m in ms] == [2.0, 3.0, 2.0, 2.0, 1.0]
    assert [m["join_cells"] for m in ms] == [2.0, 1.0, 0.0, 1.0, 1.0]
    assert [m["join_source"] for m in ms] == ["build", "rank", "none", "rank", "peer"]
    assert [m["version"] for m in ms] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [m["optimizer_step"] for m in ms] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert all(m["attempts"] == 1.0 for m in ms), json.dumps(failed)  # whole, with each reason
    # every joiner's parameters were the committed ones (the coordinator compares checksums)
    assert len({m["joined_checksum"] for m in ms}) == 5
    assert rel_diff(_params(clean), final, _params(learner())) <= 1e-3
    assert "state from peer" in (tmp_path / "cell-2.log").read_text()


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_rank_failing_mid_update_leaves_the_survivors_to_restore_and_redo_it(tmp_path, action):
    base = learner()
    batches = [trajectories(base, seed=s) for s in (6, 7)]
    clean = learner()
    for b in batches:
        clean.rl_step(b)
    # the second update's first minibatch kills (or stops) cell-2
    ranks = Ranks(tmp_path, 3, env={2: {"CELLFLIP_FAILPOINTS": f"training.after_minibatch=3*{action}"}})
    published = []
    try:
        coord = coordinator(learner(), ranks.host.address, timeout_s=15, ack_timeout_s=15)
        cells = ["cell-0", "cell-1", "cell-2"]
        m1 = coord.update(batches[0], cells, next_version=lambda: published.append(1) or 1)
        m2 = coord.update(batches[1], cells, next_version=lambda: published.append(2) or 2)
        final = committed_params(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert m1["attempts"] == 1.0 and published == [1, 2]  # one version per step, none twice
    assert m2["attempts"] == 2.0 and m2["cells_lost"] == 1.0 and m2["train_cells"] == 2.0
    # the survivors restored the start-of-update state they held: nothing was sent again
    assert m2["join_cells"] == 0.0 and m2["join_source"] == "none"
    logs = (tmp_path / "cell-0.log").read_text()
    assert "restored the start-of-update state" in logs
    assert rel_diff(_params(clean), final, _params(base)) <= 1e-3


def test_the_only_training_rank_dying_leaves_the_state_on_a_peer(tmp_path):
    base = learner()
    batches = [trajectories(base, seed=s) for s in (8, 9)]
    clean = learner()
    for b in batches:
        clean.rl_step(b)
    ranks = Ranks(tmp_path, 3, env={0: {"CELLFLIP_FAILPOINTS": "training.after_minibatch=3*kill"}})
    try:
        coord = coordinator(learner(), ranks.host.address, timeout_s=10, ack_timeout_s=10)
        coord.update(batches[0], ["cell-0", "cell-1"], next_version=lambda: coord.version + 1)
        set_json(coord.store, request_key("cell-1", 1), {"op": "flip"})  # cell-1 back to rollout, state parked
        assert wait_json(coord.store, reply_key("cell-1", 1), 30) == {"mode": "flip"}
        with pytest.raises(StepFailed):  # cell-0, the step's only rank, dies mid-update
            coord.update(batches[1], ["cell-0"], next_version=lambda: coord.version + 1, peers=["cell-1"])
        assert ranks.procs["cell-0"].wait(timeout=30) != 0
        # the trainer retries the step on the next cell it gets: cell-1's parked copy serves it
        m = coord.update(batches[1], ["cell-2"], next_version=lambda: coord.version + 1,
                         peers=["cell-0", "cell-1"])
        final = committed_params(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert m["version"] == 2.0 and m["join_source"] == "peer" and m["attempts"] == 1.0
    assert rel_diff(_params(clean), final, _params(base)) <= 1e-3


class _Killed(BaseException):
    """The coordinator process dying: nothing after it runs, no abort is written."""


def test_a_coordinator_dying_before_its_commit_is_redone_by_its_restart(tmp_path):
    base = learner()
    batch = trajectories(base, seed=5)
    clean = learner()
    clean.rl_step(batch)
    ranks = Ranks(tmp_path, 2)
    cells = ["cell-0", "cell-1"]
    published: list[int] = []
    try:
        dying = coordinator(learner(), ranks.host.address, timeout_s=15, ack_timeout_s=15)

        def die(*a, **k):
            raise _Killed()

        dying._commit = die  # the cells computed the update; the coordinator dies before committing
        with pytest.raises(_Killed):
            dying.update(batch, cells, next_version=lambda: published.append(1) or 1)
        coord = coordinator(learner(), ranks.host.address, timeout_s=15, ack_timeout_s=15)
        m = coord.update(batch, cells, next_version=lambda: published.append(1) or 1)
        final = committed_params(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert published == [1] and m["version"] == 1.0  # one version, from the restarted coordinator
    assert m["attempts"] == 1.0
    assert rel_diff(_params(clean), final, _params(base)) <= 1e-3

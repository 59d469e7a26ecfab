"""Elastic membership and faults, with bare training ranks in their own processes: a cell joins
between steps and another leaves without anyone restarting; a rank SIGKILLed or stalled in the
middle of an update never leaves a half-applied update anywhere -- the step is redone by the
others and equals the fault-free one."""

from __future__ import annotations

import pytest
import torch

from cells.training.bare import reply_key, request_key
from cells.training.coordinator import TrainingCoordinator
from cells.training.wire import pack, state_checksum
from cells.transport.store import set_json, wait_json
from tests.training.cluster import Ranks, learner, rel_diff, trajectories

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _assert_packed_ahead(coord: TrainingCoordinator, lrn) -> None:
    """What a joiner gets was packed ahead, at the commit, from the cells' result: it is
    bitwise what packing the host state now gives."""
    ahead = coord._packed_state()
    meta, flat, idx = pack(lrn)
    assert ahead["how"] == "ahead" and {k: v for k, v in ahead["meta"].items() if k != "pieces"} == meta
    assert torch.equal(torch.cat(ahead["values"]), flat) and torch.equal(torch.cat(ahead["rows"]), idx)


def test_a_cell_joins_and_another_leaves_between_steps(tmp_path):
    lrn = learner()
    batches = [trajectories(lrn, seed=s) for s in range(3)]
    ranks = Ranks(tmp_path, 3)
    try:
        coord = TrainingCoordinator(lrn, ranks.host.address, timeout_s=30, ack_timeout_s=30)
        v = lambda: lrn.version  # noqa: E731
        m1 = coord.update(batches[0], ["cell-0", "cell-1"], next_version=v)
        pids = {c: p.pid for c, p in ranks.procs.items()}
        _assert_packed_ahead(coord, lrn)
        m2 = coord.update(batches[1], ["cell-0", "cell-1", "cell-2"], next_version=v)  # cell-2 joins
        m3 = coord.update(batches[2], ["cell-1", "cell-2"], next_version=v)  # cell-0 left
        # cell-1 flips out of the training role and back (a rollout stint with no step in it):
        # it keeps its state, still the coordinator's, and needs nothing at the next step
        set_json(coord.store, request_key("cell-1", 1), {"op": "flip"})
        assert wait_json(coord.store, reply_key("cell-1", 1), 30) == {"mode": "flip"}
        # cell-0 comes back holding step 2's state: the current one is written over it in place
        m4 = coord.update(batches[0], ["cell-0", "cell-1"], next_version=v)
        _assert_packed_ahead(coord, lrn)  # results received into reused buffers, installed in place
        joins = {c: [ln for ln in (tmp_path / f"{c}.log").read_text().splitlines() if ": state of" in ln]
                 for c in ("cell-0", "cell-2")}
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert {c: p.pid for c, p in ranks.procs.items()} == pids  # nobody restarted
    ms = (m1, m2, m3, m4)
    assert [m["train_cells"] for m in ms] == [2.0, 3.0, 2.0, 2.0]
    # cell-2 received the state (verified bitwise against the host's by the coordinator: the
    # checksum of what it rebuilt); the two that trained step 1 kept theirs; at step 4 only
    # cell-0 (cell-1 kept its state through its flip)
    assert [m["join_cells"] for m in ms] == [2.0, 1.0, 0.0, 1.0]
    assert [m["version"] for m in ms] == [1.0, 2.0, 3.0, 4.0]
    assert [m["optimizer_step"] for m in ms] == [2.0, 4.0, 6.0, 8.0]
    assert all(m["attempts"] == 1.0 for m in ms)
    # both later joins wrote into a learner the cell held: cell-2's prepared while it waited
    # through step 1, cell-0's own from step 2
    assert len(joins["cell-2"]) == 1 and "(in place)" in joins["cell-2"][0], joins
    assert len(joins["cell-0"]) == 2 and "(in place)" in joins["cell-0"][1], joins


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_rank_failing_mid_update_leaves_no_half_applied_update(tmp_path, action):
    base = learner()
    batch = trajectories(base, seed=7)
    clean = learner()
    clean.rl_step(batch)
    lrn = learner()
    before = state_checksum(lrn)
    ranks = Ranks(tmp_path, 3, env={2: {"CELLFLIP_FAILPOINTS": f"training.after_minibatch={action}"}})
    published = []

    def next_version() -> int:
        published.append(lrn.version)
        return lrn.version

    try:
        coord = TrainingCoordinator(lrn, ranks.host.address, timeout_s=15, ack_timeout_s=15)
        m = coord.update(batch, ["cell-0", "cell-1", "cell-2"], next_version=next_version)
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert state_checksum(lrn) != before
    assert m["attempts"] == 2.0 and m["cells_lost"] == 1.0 and m["train_cells"] == 2.0
    assert published == [1]  # one version, from the redone step only
    theta0 = {k: p.detach().clone() for k, p in base.params.items()}
    d = rel_diff({k: p.detach() for k, p in clean.params.items()}, {k: p.detach() for k, p in lrn.params.items()}, theta0)
    assert d <= 1e-3, d


class _Killed(BaseException):
    """The coordinator process dying: nothing after it runs, no abort is written."""


def test_a_coordinator_dying_before_its_commit_is_redone_by_its_restart(tmp_path):
    base = learner()
    batch = trajectories(base, seed=5)
    clean = learner()
    clean.rl_step(batch)
    checkpoint = learner().state_dict()  # the last checkpoint: before this step
    ranks = Ranks(tmp_path, 2)
    cells = ["cell-0", "cell-1"]
    published: list[int] = []
    try:
        first = learner()
        dying = TrainingCoordinator(first, ranks.host.address, timeout_s=15, ack_timeout_s=15)

        def die(*a, **k):
            raise _Killed()

        dying._commit = die  # the cells computed the update; the coordinator dies before committing
        with pytest.raises(_Killed):
            dying.update(batch, cells, next_version=lambda: published.append(first.version) or first.version)
        restarted = learner(seed=1)
        restarted.load_state_dict(checkpoint)
        coord = TrainingCoordinator(restarted, ranks.host.address, timeout_s=15, ack_timeout_s=15)
        m = coord.update(batch, cells, next_version=lambda: published.append(restarted.version) or restarted.version)
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert published == [1] and m["version"] == 1.0  # one version, from the restarted coordinator
    assert m["attempts"] == 1.0 and m["join_cells"] == 2.0  # both dropped the uncommitted update
    theta0 = {k: p.detach().clone() for k, p in base.params.items()}
    d = rel_diff({k: p.detach() for k, p in clean.params.items()}, {k: p.detach() for k, p in restarted.params.items()}, theta0)
    assert d <= 1e-3, d

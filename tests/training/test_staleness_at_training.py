"""The staleness bound holds where tokens are trained: a sampled token from more than
`staleness_bound` versions before the update's start leaves the loss (`mask_stale`), a partly
stale multi-turn session trains its fresh tokens, its reward still counts in its group, and a
rank handed a stale token refuses to train it."""

from __future__ import annotations

import pytest
import torch

from cells.rl.plan import Share, mask_stale, plan_update
from cells.rl.reduce import LocalReducer
from cells.rl.update import run_update
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory

torch.set_num_threads(1)


def _session(learner, completion, reward, sid, versions):
    """A two-turn session whose sampled tokens carry `versions` (first turn, second turn)."""
    t = trajectory(learner, PROMPT, completion, reward, sid=sid)
    n = len(t["token_ids"])
    half = len(PROMPT) + len(completion) // 2
    t["versions"] = [None if not m else (versions[0] if i < half else versions[1])
                     for i, m in enumerate(t["loss_mask"])]
    assert n == len(t["versions"])
    return t


def test_tokens_past_the_bound_leave_the_loss_and_the_rest_train():
    learner = small_learner()
    learner.version = 10
    fresh = _session(learner, GOOD, 1.0, "a", (9, 10))
    partly = _session(learner, BAD, 0.0, "b", (7, 10))  # its first turn is 3 versions old
    out, dropped = mask_stale([fresh, partly], version=10, bound=2)
    sampled = sum(partly["loss_mask"])
    assert dropped == sum(1 for m, v in zip(partly["loss_mask"], partly["versions"]) if m and v == 7) > 0
    assert out[0] is fresh and sum(out[1]["loss_mask"]) == sampled - dropped > 0
    assert partly["loss_mask"].count(1) == sampled  # the input is not changed
    # the plan: the same tokens out of N0, the group's advantages as if nothing were stale
    plain = plan_update([fresh, partly], learner.objective, 1, [1.0], version=10, staleness_bound=None)
    bound = plan_update([fresh, partly], learner.objective, 1, [1.0], version=10, staleness_bound=2)
    assert bound.stale_tokens_dropped == dropped and plain.stale_tokens_dropped == 0
    assert sum(bound.shares[0].n0) == sum(plain.shares[0].n0) - dropped
    assert bound.advantages == plain.advantages
    assert bound.metrics()["stale_tokens_dropped"] == float(dropped)
    # negative control: within the bound nothing leaves
    assert mask_stale([fresh, partly], version=10, bound=3)[1] == 0


def test_an_update_under_the_bound_trains_only_fresh_tokens():
    a, b = small_learner(minibatches=1), small_learner(minibatches=1)
    for lrn in (a, b):
        lrn.version = 10

    def batch(lrn):  # a wholly stale group and a fresh one
        # the stale group pulls the other way (Adam's first step is the gradient's sign)
        old = [_session(lrn, GOOD, 0.0, "a", (4, 4)), _session(lrn, BAD, 1.0, "b", (4, 4))]
        new = [_session(lrn, GOOD, 1.0, "c", (9, 10)), _session(lrn, BAD, 0.0, "d", (9, 10))]
        for t in old:
            t["group_id"] = "old"
        return old + new

    m = a.rl_step(batch(a), staleness_bound=2)
    assert m["stale_tokens_dropped"] > 0
    fresh_only = [t for t in batch(b) if t["id"] in ("c", "d")]
    b.rl_step(fresh_only)  # the same update from the fresh sessions alone: equal parameters
    assert all(torch.allclose(a.params[k], b.params[k], atol=1e-6) for k in a.params)
    c = small_learner(minibatches=1)  # negative control: without the bound the stale group trains too
    c.version = 10
    c.rl_step(batch(c))
    assert not all(torch.allclose(a.params[k], c.params[k], atol=1e-6) for k in a.params)


def test_a_rank_refuses_a_stale_token_the_plan_left_in():
    learner = small_learner()
    learner.version = 10
    trajs = [_session(learner, GOOD, 1.0, "a", (5, 5)), _session(learner, BAD, 0.0, "b", (10, 10))]
    plan = plan_update(trajs, learner.objective, 1, [1.0], version=10, staleness_bound=None)
    s = plan.shares[0]
    forged = Share(s.trajectories, s.advantages, s.minibatch, s.n0, staleness_bound=2)
    with pytest.raises(ValueError, match="past the staleness bound"):
        run_update(learner, forged, LocalReducer())

"""The update's trust-region guard (cells/rl/guard.py): an update that moves the policy
past `max_update_kl` on its own batch is rolled back whole (parameters, optimizer moments, EWMA,
step counter bitwise, the minibatches before a stop included), the version does not advance,
and the KL it reports is the one an independent forward before and after the update measures."""

from __future__ import annotations

import pytest
import torch

from cells.rl.objectives import ObjectiveConfig
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory
from tests.training.cluster import Ranks, committed_params, coordinator, learner, trajectories

torch.set_num_threads(1)
GUARDED = ObjectiveConfig(max_update_kl=0.15)
"""A bound the tiny model's steps cross at 1e-2 (0.27 nats) and stay under at 1e-3 (0.05)."""


def _batch(lrn):
    return [trajectory(lrn, PROMPT, GOOD, 1.0, sid="a"), trajectory(lrn, PROMPT, BAD, 0.0, sid="b"),
            trajectory(lrn, PROMPT, GOOD[:2] + BAD[2:], 1.0, sid="c"),
            trajectory(lrn, PROMPT, BAD[:2] + GOOD[2:], 0.0, sid="d")]


def _k3(before: list[torch.Tensor], after: list[torch.Tensor], batch: list[dict]) -> float:
    """Mean k3 KL(before ‖ after) over the sampled tokens, from plain per-sequence forwards:
    r = π_after/π_before (the batch is on-policy: its tokens were drawn from `before`)."""
    terms = []
    for t, b, a in zip(batch, before, after):
        mask = torch.tensor(t["loss_mask"][1:], dtype=torch.bool)
        log_r = (a - b)[mask]
        terms.append(log_r.exp() - 1.0 - log_r)
    return float(torch.cat(terms).mean())


def _state(lrn) -> dict:
    opt = lrn.optimizer.state_dict()["state"]
    return {"params": {k: p.detach().clone() for k, p in lrn.params.items()},
            "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()},
            "ewma": {k: v.clone() for k, v in lrn.ewma.params.items()}, "step": lrn.step}


def _equal(a: dict, b: dict) -> bool:
    same = a["step"] == b["step"] and a["opt"].keys() == b["opt"].keys()
    same &= all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    same &= all(torch.equal(a["ewma"][k], b["ewma"][k]) for k in a["ewma"])
    return same and all(torch.equal(v, b["opt"][i][k]) for i, s in a["opt"].items() for k, v in s.items())


def _measured(lr: float) -> float:
    """The second update's KL (the first at 1e-3) from an unguarded twin, measured by
    forwards before and after."""
    twin = small_learner(lr=1e-3)
    twin.rl_step(_batch(twin))  # moments in the optimizer state, as in a running job
    twin.lr = lr
    batch = _batch(twin)
    before = [twin.logprobs(t["token_ids"]) for t in batch]
    twin.rl_step(batch)
    return _k3(before, [twin.logprobs(t["token_ids"]) for t in batch], batch)


def test_an_update_within_the_bound_is_kept_and_reports_the_measured_kl():
    lrn = small_learner(guard=True, objective=GUARDED, lr=1e-3)
    lrn.rl_step(_batch(lrn))
    start = _state(lrn)
    m = lrn.rl_step(_batch(lrn))
    assert m["update_rejected"] == 0.0 and m["minibatches_run"] == 1.0 and lrn.step == start["step"] + 1
    assert not _equal(start, _state(lrn))
    assert 0.0 < m["update_kl"] < lrn.objective.max_update_kl
    assert m["update_kl"] == pytest.approx(_measured(1e-3), rel=1e-4)


def test_an_update_past_the_bound_is_rolled_back_whole():
    lrn = small_learner(guard=True, objective=GUARDED, lr=1e-3)
    lrn.rl_step(_batch(lrn))  # a kept update first: the optimizer has moments to restore
    lrn.lr = 1e-2  # the tiny model moves by about a nat in one step at this rate
    start, version = _state(lrn), lrn.version
    m = lrn.rl_step(_batch(lrn))
    assert m["update_rejected"] == 1.0 and m["update_kl"] > lrn.objective.max_update_kl
    assert m["update_kl"] == pytest.approx(_measured(1e-2), rel=1e-4)
    assert _equal(start, _state(lrn))  # bitwise: parameters, moments, EWMA, step counter
    assert lrn.version == version  # nothing to publish: the version it started at
    assert m["staleness_mean"] == 0.0 and m["staleness_max"] == 0.0  # on-policy, measured at the start
    m = lrn.rl_step(_batch(lrn))  # the next update starts from the restored state
    assert lrn.step in (start["step"], start["step"] + 1)


def test_the_second_minibatch_stops_an_update_the_first_step_already_moved_too_far():
    lrn = small_learner(guard=True, objective=GUARDED, lr=5e-2, minibatches=2)
    start = _state(lrn)
    m = lrn.rl_step(_batch(lrn))
    assert m["minibatches_run"] == 1.0 and m["num_minibatches"] == 2.0
    assert m["update_rejected"] == 1.0 and m["update_kl"] > lrn.objective.max_update_kl
    assert _equal(start, _state(lrn))


def test_without_a_bound_nothing_is_rolled_back():
    lrn = small_learner(lr=1e-2, objective=ObjectiveConfig(max_update_kl=None))
    start = _state(lrn)
    m = lrn.rl_step(_batch(lrn))
    assert m["update_rejected"] == 0.0 and m["update_kl"] > 0.3 and not _equal(start, _state(lrn))


@pytest.mark.slow
def test_two_training_ranks_reject_together_and_commit_the_start_weights(tmp_path):
    lrn = learner(lr=0.5, max_grad_norm=1.0)  # far past any bound in one step
    start = {k: p.detach().clone() for k, p in lrn.params.items()}
    ranks = Ranks(tmp_path, 2)
    try:
        coord = coordinator(lrn, ranks.host.address)
        m = coord.update(trajectories(lrn), ["cell-0", "cell-1"], shares=[1.0, 1.0],
                         next_version=lambda: coord.version + 1)
        after = committed_params(coord, tmp_path / "ckpt")
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert m["train_cells"] == 2.0  # both ranks agreed, committed
    assert m["update_rejected"] == 1.0 and m["version"] == 0.0  # committed under the version it started at
    assert all(torch.equal(start[k], after[k]) for k in start)


def test_the_snapshot_is_taken_into_the_previous_ones_tensors():
    from cells.rl import guard

    lrn = small_learner(guard=True, objective=GUARDED, lr=1e-3)
    lrn.rl_step(_batch(lrn))
    a = guard.take(lrn)
    ptrs = {k: t.data_ptr() for k, t in a.params.items()}
    lrn.rl_step(_batch(lrn))  # takes (and keeps) its own snapshot into the same tensors
    b = guard.take(lrn)
    assert {k: t.data_ptr() for k, t in b.params.items()} == ptrs
    assert all(torch.equal(b.params[k], p.detach()) for k, p in lrn.params.items())


def test_moment_buffers_outlive_a_snapshot_taken_without_moments():
    from cells.rl import guard

    lrn = small_learner(guard=True, objective=GUARDED, lr=1e-3)
    lrn.rl_step(_batch(lrn))
    first = guard.take(lrn)
    ptrs = {k: m["exp_avg"].data_ptr() for k, m in first.moments.items()}
    lrn.start_rl()  # a fresh RL start: no moments
    assert guard.take(lrn).moments == {}
    lrn.rl_step(_batch(lrn))
    again = guard.take(lrn)
    assert ptrs and {k: m["exp_avg"].data_ptr() for k, m in again.moments.items()} == ptrs

"""The per-token weights an update multiplied each token's objective by,
w_t = c_d(r_d) · min(r_stale, C_s), kept per trajectory for the write-back: what the ranks
computed is what the formula gives from the trajectory's own log-probs, over loss-mask tokens
in buffer order; a wrong weight is caught by that same check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cells.rl.objectives import ObjectiveConfig
from cells.rl.objectives.config import TISTokenCorrection
from cells.rl.used_weights import decode, encode
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory

torch.set_num_threads(1)


def _off_policy(learner, completion, reward, sid, shift):
    """A trajectory whose behaviour log-probs sit `shift[k]` below the exact old ones (r_d ≠ 1)."""
    t = trajectory(learner, PROMPT, completion, reward, sid=sid)
    k = 0
    for i, m in enumerate(t["loss_mask"]):
        if m:
            t["logprobs"][i] = t["old_logprobs"][i] - shift[k % len(shift)]
            k += 1
    return t


def _expected(t, lp_prox, cap, stale_cap):
    """w_t by the formula (RL_MATH.md), over the trajectory's loss-mask tokens in order."""
    out = []
    for i, m in enumerate(t["loss_mask"]):
        if m:
            rho = math.exp(t["old_logprobs"][i] - t["logprobs"][i])
            out.append(min(rho, cap) * min(math.exp(lp_prox[i - 1] - t["old_logprobs"][i]), stale_cap))
    return np.array(out)


def _matches(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-5, atol=1e-7))


def test_the_weights_written_back_are_the_ones_the_update_used():
    obj = ObjectiveConfig(correction=TISTokenCorrection(cap=1.5), staleness_cap=2.0)
    learner = small_learner(objective=obj, minibatches=1)
    trajs = [_off_policy(learner, GOOD, 1.0, "a", [0.0, 0.3, 1.2]), _off_policy(learner, BAD, 0.0, "b", [-0.2, 0.6])]
    # the update starts from these parameters: lp_prox is their forward (equal to lp_old: r_stale = 1)
    prox = {t["id"]: learner.logprobs(t["token_ids"]).tolist() for t in trajs}
    learner.rl_step(trajs)
    used = learner.used_weights
    assert sorted(used) == ["a", "b"]
    for t in trajs:
        got, want = decode(used[t["id"]]), _expected(t, prox[t["id"]], 1.5, 2.0)
        assert len(got) == sum(t["loss_mask"]) and _matches(got, want), (got, want)
    every = np.concatenate([decode(v) for v in used.values()])
    assert every.min() < 1.0 and (every == 1.5).any()  # the correction moved them, the cap bound one
    # negative controls: one weight wrong, or another session's weights, fail the same check
    bad = decode(used["a"]).copy()
    bad[1] *= 1.01
    assert not _matches(decode(encode(bad)), _expected(trajs[0], prox["a"], 1.5, 2.0))
    assert not _matches(decode(used["b"]), _expected(trajs[0], prox["a"], 1.5, 2.0))


def test_tokens_that_leave_the_loss_weigh_zero_and_untrained_ones_are_nan():
    from cells.rl.objectives.config import MISTokenCorrection

    obj = ObjectiveConfig(correction=MISTokenCorrection(low=0.5, high=2.0))
    learner = small_learner(objective=obj, minibatches=1)
    far = _off_policy(learner, GOOD, 1.0, "a", [0.0, 2.0])  # rho = e^2 for every other token: masked out
    other = _off_policy(learner, BAD, 0.0, "b", [0.0])
    two = dict(other, id="c", segment_starts=[0, 2])  # a segment starting at 2: its first token is trained by no row
    two["loss_mask"] = [1 if i == 2 else m for i, m in enumerate(other["loss_mask"])]
    for k in ("logprobs", "old_logprobs"):
        two[k] = [-1.0 if i == 2 else v for i, v in enumerate(other[k])]
    two["versions"] = [learner.version if i == 2 else v for i, v in enumerate(other["versions"])]
    two["provenance"] = ["exact" if i == 2 else v for i, v in enumerate(other["provenance"])]
    learner.rl_step([far, other, two])
    w = decode(learner.used_weights["a"])
    assert (w[1::2] == 0).all() and (w[0::2] > 0).all()
    c = decode(learner.used_weights["c"])
    assert np.isnan(c[0]) and not np.isnan(c[1:]).any()


@pytest.mark.slow
def test_two_training_ranks_send_their_shares_weights_to_the_coordinator(tmp_path):
    from tests.training.cluster import Ranks, coordinator, learner, trajectories

    base = learner()
    batch = trajectories(base, seed=1)
    local = learner()
    local.rl_step(batch)
    ranks = Ranks(tmp_path, 2)
    try:
        coord = coordinator(learner(), ranks.host.address)
        coord.update(batch, ["cell-0", "cell-1"], shares=[1.0, 3.0], next_version=lambda: coord.version + 1)
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    assert sorted(coord.used_weights) == sorted(t["id"] for t in batch)
    for t in batch:
        got = decode(coord.used_weights[t["id"]])
        assert len(got) == sum(t["loss_mask"]) and _matches(got, decode(local.used_weights[t["id"]]))


def test_a_forked_episodes_branches_get_their_own_pairs_weights():
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS
    from cells.rl.learner import Learner
    from tests.trainer.test_tree_training import _forked_group

    spec = PRESETS["toy"]
    learner = Learner(spec, init_weights(spec, 5, 0.1), lr=1e-3, minibatches=1, max_grad_norm=None)
    trajs = _forked_group(learner)  # t, t.b1, t.b2 (one tree), u (rows)
    prox = {t["id"]: learner.logprobs(t["token_ids"]).tolist() for t in trajs}
    learner.rl_step(trajs)
    wants = {}
    for t in trajs:
        got = decode(learner.used_weights[t["id"]])
        want = []
        for i, m in enumerate(t["loss_mask"]):
            if m:  # at the update's start lp_prox = lp_old = lp_stand: w = min(rho, 2)
                anchor = t["old_logprobs"][i] if t["provenance"][i] == "exact" else prox[t["id"]][i - 1]
                want.append(min(math.exp(anchor - t["logprobs"][i]), 2.0))
        assert not np.isnan(got).any() and _matches(got, np.array(want)), t["id"]
        wants[t["id"]] = np.array(want)
    # negative controls: the trunk's weights placed one token off, or another member's, fail
    got = decode(learner.used_weights["t"])
    assert not _matches(got[1:], wants["t"][:-1]) and not _matches(decode(learner.used_weights["u"]), wants["t"])

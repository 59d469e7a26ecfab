"""The loss variants against numbers computed by hand: the three aggregations (token mean,
sequence mean of token means, Dr. GRPO's sequence mean of token sums over a constant), the
advantage without the group std, GSPO's sequence ratio and its clip (a sequence split over
rows keeps one ratio), and the same variants through the whole RL step (plan, batch, update)
against an explicit autograd of the hand formula. The 1-vs-2-training-cell sums are in
tests/training/test_parity.py; a loss of one's own in test_custom_loss.py."""

from __future__ import annotations

import math

import pytest
import torch

from cells.engine.embedded.model import prepare, token_logprobs
from cells.rl.objectives import ObjectiveConfig, decoupled_ppo_loss, member_advantages
from cells.rl.objectives.advantages import compute_advantages
from cells.rl.objectives.config import GRPOAdvantage
from cells.rl.objectives.ppo import agg_scale, sequence_log_ratio
from tests.trainer.test_learner import PROMPT, small_learner, trajectory

torch.set_num_threads(1)

F64 = torch.float64
# two sequences, 2 and 4 sampled tokens (row 0 padded), advantages +1 and +0.5
LP = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -1.5, -1.0, -2.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
ADV = torch.tensor([1.0, 0.5], dtype=F64)
LENGTHS = torch.tensor([2.0, 4.0])


def _loss_and_grad(cfg: ObjectiveConfig, lp_theta: torch.Tensor, seq_index=None, scale_lengths=LENGTHS,
                   s0: int = 2, adv=ADV, lp_prox=LP, mask=MASK):
    lp_theta = lp_theta.clone().requires_grad_()
    scale = agg_scale(cfg, scale_lengths, s0)
    loss, m = decoupled_ppo_loss(lp_theta, lp_prox, lp_prox.clone(), adv, mask, cfg, lp_old=lp_prox.clone(),
                                 token_scale=None if scale is None else scale.to(F64), seq_index=seq_index)
    (g,) = torch.autograd.grad(loss, lp_theta)
    return float(loss.detach()), g, m


@pytest.mark.parametrize("agg,loss,g0,g1", [
    # on-policy (r = 1): loss = −Σ c·A, d loss/d lp_t = −c·A for each sampled token
    ("token_mean", -(2 * 1.0 + 4 * 0.5) / 6, -1.0 / 6, -0.5 / 6),
    ("seq_mean_token_mean", -(1.0 + 0.5) / 2, -1.0 / (2 * 2), -0.5 / (2 * 4)),
    ("seq_mean_token_sum_norm", -(2 * 1.0 + 4 * 0.5) / (2 * 8.0), -1.0 / (2 * 8.0), -0.5 / (2 * 8.0)),
])
def test_each_aggregation_by_hand(agg, loss, g0, g1):
    cfg = ObjectiveConfig(loss_agg=agg, loss_agg_constant=8.0)
    got, g, _ = _loss_and_grad(cfg, LP)
    assert got == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(g, torch.tensor([[g0, g0, 0, 0], [g1, g1, g1, g1]], dtype=F64))


def test_the_aggregations_differ_on_unequal_lengths():
    """The negative control: the three weightings are not the same loss."""
    values = {a: _loss_and_grad(ObjectiveConfig(loss_agg=a, loss_agg_constant=8.0), LP)[0]
              for a in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")}
    assert len({round(v, 9) for v in values.values()}) == 3, values


def test_advantage_without_the_group_std_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    centred = [1 - 1 / 3, -1 / 3, -1 / 3, 1.0, -1.0]
    none = compute_advantages(rewards, GRPOAdvantage(), groups, norm="none")
    assert none.tolist() == pytest.approx(centred)
    assert member_advantages(rewards, GRPOAdvantage(), groups, torch.arange(5), "none").tolist() == \
        pytest.approx(centred)
    scaled = compute_advantages(rewards, GRPOAdvantage(eps=0.0), groups)  # the default divides
    std0, std1 = math.sqrt((4 / 9 + 2 / 9) / 2), math.sqrt(2.0)
    assert scaled.tolist() == pytest.approx([c / s for c, s in zip(centred, [std0] * 3 + [std1] * 2)])


def test_gspo_sequence_ratio_and_its_clip_by_hand():
    # row 0: log r_t = (−0.1, +0.5): token ratios 0.905 (inside the clip) and 1.65 (clipped);
    #        sequence ratio s = e^{0.2} = 1.221 > 1 + 0.1 with A > 0: the whole sequence clipped
    # row 1: log r_t = (0.02, −0.02, 0.04, −0.04): s = 1, inside: each token's gradient is
    #        −c·A·s (|seq| tokens of s·A, ∂s/∂lp_t = s/|seq|)
    delta = torch.tensor([[-0.1, 0.5, 0.0, 0.0], [0.02, -0.02, 0.04, -0.04]], dtype=F64)
    cfg = ObjectiveConfig(ratio="sequence", clip_low=0.1, clip_high=0.1)
    loss, g, m = _loss_and_grad(cfg, LP + delta)
    s0 = math.exp(0.2)
    assert loss == pytest.approx(-(2 * 1.1 * 1.0 + 4 * 1.0 * 0.5) / 6, rel=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0, 0, 0, 0], [-0.5 / 6] * 4], dtype=F64))
    assert m["clip_frac"] == pytest.approx(2 / 6) and m["mean_r_t"] == pytest.approx((2 * s0 + 4) / 6)
    # the negative control: the token ratio trains token 0 of row 0 and weighs row 1 by r_t
    _, g_tok, _ = _loss_and_grad(cfg.model_copy(update={"ratio": "token"}), LP + delta)
    assert float(g_tok[0, 0]) == pytest.approx(-math.exp(-0.1) / 6) and float(g_tok[0, 1]) == 0.0
    assert not torch.allclose(g_tok[1], g[1])


def test_a_sequence_split_over_rows_keeps_one_ratio():
    """A multi-turn trajectory's segments are rows of one sequence: GSPO's s is the mean over
    all of them, the same as over one row holding them all."""
    log_r = torch.tensor([[0.3, 0.1, 0.0], [-0.2, 0.0, 0.0], [0.4, 0.0, 0.0]], dtype=F64)
    keep = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    s = sequence_log_ratio(log_r, keep, torch.tensor([0, 0, 1]))
    assert s[0, 0] == s[1, 0] == pytest.approx((0.3 + 0.1 - 0.2) / 3) and float(s[2, 0]) == pytest.approx(0.4)
    split = sequence_log_ratio(log_r, keep, None)  # each row its own: different
    assert float(split[0, 0]) != pytest.approx(float(s[0, 0]))
    one = sequence_log_ratio(torch.tensor([[0.3, 0.1, -0.2]], dtype=F64), torch.ones(1, 3, dtype=torch.bool), None)
    assert float(one[0, 0]) == pytest.approx(float(s[0, 0]), rel=1e-12)


# -- through the RL step ----------------------------------------------------------------------
COMPLETIONS = ([5, 6, 501], [30, 31, 32, 33, 34, 35, 501], [7, 8, 9, 10, 501])
REWARDS = (1.0, 0.0, 0.0)


def _coefficients(agg: str, norm: str, constant: float) -> list[float]:
    """Each trajectory's per-token coefficient c_i of −Σ_i c_i Σ_t lp_t (at r = 1), by hand."""
    n = [len(c) for c in COMPLETIONS]
    mean = sum(REWARDS) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / 2)
    adv = [(r - mean) / (std + 1e-6) if norm == "group_std" else r - mean for r in REWARDS]
    if agg == "token_mean":
        return [a / sum(n) for a in adv]
    if agg == "seq_mean_token_mean":
        return [a / (3 * k) for a, k in zip(adv, n)]
    return [a / (3 * constant) for a in adv]


@pytest.mark.parametrize("agg,norm,ratio", [
    ("token_mean", "group_std", "token"),
    ("seq_mean_token_mean", "group_std", "sequence"),
    ("seq_mean_token_sum_norm", "none", "token"),
])
def test_the_rl_step_takes_the_configured_variant(agg, norm, ratio):
    """The first optimizer step's gradient (one minibatch, on-policy) is that of the hand
    formula −Σ_i c_i Σ_t log π(t), differentiated through the model's own forward."""
    cfg = ObjectiveConfig(loss_agg=agg, loss_agg_constant=16.0, advantage_norm=norm, ratio=ratio,
                          max_update_kl=None)
    learner = small_learner(objective=cfg, minibatches=1, max_grad_norm=None)
    trajs = [trajectory(learner, PROMPT, c, r, sid=f"s{i}") for i, (c, r) in enumerate(zip(COMPLETIONS, REWARDS))]
    params = {k: v.detach().clone().requires_grad_(True) for k, v in learner.params.items()}
    prep = prepare(learner.spec, params)
    expect, value = 0.0, 0.0  # value: the loss at r = 1, −Σ_i c_i |seq_i|
    for c, t, comp in zip(_coefficients(agg, norm, 16.0), trajs, COMPLETIONS):
        lp = token_logprobs(prep, torch.tensor(t["token_ids"]), 1.0, learner.tile)
        expect = expect - c * lp[len(PROMPT) - 1:].sum()
        value -= c * len(comp)
    expect.backward()
    got = {}
    step = learner.apply_gradients

    def capture() -> float:
        got.update({k: p.grad.clone() for k, p in learner.params.items()})
        return step()

    learner.apply_gradients = capture
    m = learner.rl_step(trajs)
    assert m["loss"] == pytest.approx(value, rel=1e-5, abs=1e-7)
    for k, p in params.items():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
    assert any(float(p.grad.abs().sum()) > 0 for p in params.values())

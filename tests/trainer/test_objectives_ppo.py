"""The decoupled PPO loss: plain-PPO limit, hand numbers, N0, dual clip, missing lp_old,
gradients, KL in the loss, metrics and bad inputs."""

import math

import pytest
import torch

from cells.rl.objectives.config import (
    KLInLoss,
    MISSequenceCorrection,
    MISTokenCorrection,
    NoCorrection,
    ObjectiveConfig,
    TISSequenceCorrection,
    TISTokenCorrection,
)
from cells.rl.objectives.ppo import PROVENANCE_MISSING, decoupled_ppo_loss, ppo_objective

torch.set_num_threads(1)

F64 = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _plain_ppo(lp_theta, lp_prox, adv, mask, eps_lo, eps_hi):
    r = torch.exp(lp_theta - lp_prox)
    a = adv.unsqueeze(-1).expand_as(r) if adv.dim() == 1 else adv
    obj = torch.minimum(r * a, r.clamp(1 - eps_lo, 1 + eps_hi) * a)
    return -(obj * mask).sum() / mask.sum()


@pytest.mark.parametrize(
    "correction",
    [
        NoCorrection(),
        TISTokenCorrection(),
        TISSequenceCorrection(),
        MISTokenCorrection(),
        MISSequenceCorrection(),
    ],
)
def test_equal_old_prox_behav_gives_plain_ppo(correction):
    g = torch.Generator().manual_seed(1)
    lp_prox = -torch.rand(4, 6, generator=g, dtype=F64) * 2
    lp_theta = (lp_prox + 0.4 * torch.randn(4, 6, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(4, generator=g, dtype=F64)
    mask = torch.ones(4, 6, dtype=F64)
    mask[1, 4:] = 0
    cfg = ObjectiveConfig(correction=correction, clip_low=0.2, clip_high=0.28)
    loss, metrics = decoupled_ppo_loss(
        lp_theta, lp_prox, lp_prox.clone(), adv, mask, cfg, lp_old=lp_prox.clone()
    )
    (grad,) = torch.autograd.grad(loss, lp_theta)
    ref = _plain_ppo(lp_theta, lp_prox, adv, mask, 0.2, 0.28)
    (ref_grad,) = torch.autograd.grad(ref, lp_theta)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics["mean_r_d"] == pytest.approx(1.0)
    assert metrics["mean_r_stale"] == pytest.approx(1.0)
    assert metrics["frac_masked"] == 0.0
    assert 0.0 < metrics["clip_frac"] < 1.0  # the noise is large enough to clip some tokens


def test_hand_computed_loss_and_metrics():
    # token 0: r_d = e^0.1, r_stale = e^0.1, r_t = e^0.3 > 1.2 with A = +1 -> clipped at 1.2
    # token 1: r_d = e^-0.2, r_stale = e^1 capped at C_s = 2, r_t = e^-0.1, A = -1 -> unclipped
    # token 2: padding (M = 0)
    lp_behav = _t([[-1.0, -2.0, 0.0]])
    lp_old = _t([[-0.9, -2.2, 0.0]])
    lp_prox = _t([[-0.8, -1.2, 0.0]])
    lp_theta = _t([[-0.5, -1.3, 0.0]])
    adv = _t([[1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    cfg = ObjectiveConfig(
        correction=TISTokenCorrection(cap=2.0), staleness_cap=2.0, clip_low=0.2, clip_high=0.2
    )
    loss, m = decoupled_ppo_loss(lp_theta, lp_prox, lp_behav, adv, mask, cfg, lp_old=lp_old)
    w0 = math.exp(0.1) * math.exp(0.1)
    w1 = math.exp(-0.2) * 2.0
    term0 = w0 * min(math.exp(0.3) * 1.0, 1.2 * 1.0)
    term1 = w1 * min(math.exp(-0.1) * -1.0, max(math.exp(-0.1), 0.8) * -1.0)
    assert loss.item() == pytest.approx(-(term0 + term1) / 2)
    assert m["loss"] == pytest.approx(loss.item()) and m["pg_loss"] == pytest.approx(loss.item())
    assert m["mean_r_d"] == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)
    assert m["mean_r_stale"] == pytest.approx((math.exp(0.1) + math.exp(1.0)) / 2)
    assert m["mean_weight"] == pytest.approx((w0 + w1) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["num_tokens"] == 2 and m["num_exact"] == 2 and m["num_missing"] == 0


def test_n0_counts_rejected_tokens_and_accepts_a_global_count():
    lp = _t([[-1.0, -1.0], [-1.0, -1.0]])
    lp_behav = lp.clone()
    lp_behav[1, 0] = 20.0  # rho = e^-21 -> clamped e^-20 < 1e-4: sequence 1 is rejected
    lp_theta = lp + _t([[0.1, -0.05], [0.3, 0.3]])
    adv = _t([1.0, 1.0])
    cfg = ObjectiveConfig(correction=NoCorrection(), clip_high=0.5)
    loss, m = decoupled_ppo_loss(lp_theta, lp, lp_behav, adv, torch.ones(2, 2), cfg, lp_old=lp)
    expected = -(math.exp(0.1) + math.exp(-0.05)) / 4  # N0 = 4, not the 2 kept tokens
    assert loss.item() == pytest.approx(expected)
    assert m["frac_masked"] == pytest.approx(0.5) and m["frac_seq_rejected"] == pytest.approx(0.5)
    global_loss, _ = decoupled_ppo_loss(
        lp_theta, lp, lp_behav, adv, torch.ones(2, 2), cfg, lp_old=lp, num_tokens=16
    )
    assert global_loss.item() == pytest.approx(expected * 4 / 16)


def test_dual_clip_caps_negative_advantage_loss():
    r = _t([5.0, 5.0, 0.5])
    adv = _t([-1.0, 2.0, -1.0])
    obj, clipped, dual = ppo_objective(r, adv, 0.2, 0.2, dual_clip=3.0)
    # A<0, r=5: min(-5, -1.2) = -5 -> loss 5 capped at 3; A>0, r=5: clipped at 1.2·2; r=0.5,A<0: -0.8
    torch.testing.assert_close(obj, _t([-3.0, 2.4, -0.8]))
    assert dual.tolist() == [True, False, False] and clipped.tolist() == [False, True, True]
    obj_plain, _, _ = ppo_objective(r, adv, 0.2, 0.2)
    torch.testing.assert_close(obj_plain, _t([-5.0, 2.4, -0.8]))

    lp_theta = torch.log(r).unsqueeze(0)
    zero = torch.zeros_like(lp_theta)
    cfg = ObjectiveConfig(correction=NoCorrection(), dual_clip=3.0)
    loss, m = decoupled_ppo_loss(
        lp_theta, zero, zero, adv.unsqueeze(0), torch.ones(1, 3), cfg, lp_old=zero
    )
    assert loss.item() == pytest.approx((3.0 - 2.4 + 0.8) / 3)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)


def test_missing_tokens_use_the_ewma_stand_in():
    nan = float("nan")
    lp_behav = _t([[-1.0, -1.0, -1.0]])
    lp_old = _t([[-1.1, nan, nan]])
    lp_stand = _t([[nan, -0.7, -1.0]])
    lp_prox = _t([[-1.0, -0.9, -1.0]])
    lp_theta = _t([[-1.0, -0.9, -1.0]])
    adv = _t([1.0])
    prov = torch.tensor([[0, PROVENANCE_MISSING, PROVENANCE_MISSING]])
    cfg = ObjectiveConfig(correction=TISTokenCorrection(cap=1.2), staleness_cap=2.0)
    loss, m = decoupled_ppo_loss(
        lp_theta,
        lp_prox,
        lp_behav,
        adv,
        torch.ones(1, 3),
        cfg,
        lp_old=lp_old,
        provenance=prov,
        lp_stand=lp_stand,
    )
    w_exact = math.exp(-0.1) * math.exp(0.1)
    w_missing = min(math.exp(0.3), 1.2) * math.exp(-0.2)  # c_d(stand/behav) · min(prox/stand, C_s)
    assert loss.item() == pytest.approx(-(w_exact + w_missing + 1.0) / 3)
    assert m["num_exact"] == 1 and m["num_missing"] == 2 and m["num_missing_kept"] == 2
    # missing tokens are not reported as exact
    assert m["mean_r_d"] == pytest.approx(math.exp(-0.1))
    assert m["mean_r_d_missing"] == pytest.approx((math.exp(0.3) + 1.0) / 2)
    loss_bool, _ = decoupled_ppo_loss(
        lp_theta,
        lp_prox,
        lp_behav,
        adv,
        torch.ones(1, 3),
        cfg,
        lp_old=lp_old,
        provenance=prov.bool(),
        lp_stand=lp_stand,
    )
    assert loss_bool.item() == loss.item()

    mis = ObjectiveConfig(correction=MISTokenCorrection(low=0.5, high=1.2))
    _, m = decoupled_ppo_loss(
        lp_theta,
        lp_prox,
        lp_behav,
        adv,
        torch.ones(1, 3),
        mis,
        lp_old=lp_old,
        provenance=prov,
        lp_stand=lp_stand,
    )
    assert m["num_missing_kept"] == 1 and m["frac_missing_kept"] == pytest.approx(0.5)


def test_missing_provenance_errors():
    x = torch.zeros(1, 2)
    cfg = ObjectiveConfig()
    with pytest.raises(ValueError, match="lp_stand"):
        decoupled_ppo_loss(
            x, x, x, x, torch.ones(1, 2), cfg, lp_old=x, provenance=torch.tensor([[0, 1]])
        )
    with pytest.raises(ValueError, match="lp_old is required"):
        decoupled_ppo_loss(x, x, x, x, torch.ones(1, 2), cfg)
    with pytest.raises(ValueError, match="unknown provenance code"):
        decoupled_ppo_loss(
            x,
            x,
            x,
            x,
            torch.ones(1, 2),
            cfg,
            lp_old=x,
            lp_stand=x,
            provenance=torch.tensor([[0, 2]]),
        )
    with pytest.raises(ValueError, match="bool or integer"):
        decoupled_ppo_loss(
            x, x, x, x, torch.ones(1, 2), cfg, lp_old=x, provenance=torch.zeros(1, 2)
        )


def test_gradients_flow_only_through_lp_theta():
    g = torch.Generator().manual_seed(2)
    mk = lambda: (-torch.rand(2, 4, generator=g, dtype=F64)).requires_grad_()
    lp_theta, lp_prox, lp_behav, lp_old, lp_stand, lp_ref = (mk() for _ in range(6))
    adv = torch.randn(2, 4, generator=g, dtype=F64, requires_grad=True)
    prov = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]])
    cfg = ObjectiveConfig(
        correction=TISSequenceCorrection(), self_normalize=True, kl=KLInLoss(coef=0.1)
    )
    loss, _ = decoupled_ppo_loss(
        lp_theta,
        lp_prox,
        lp_behav,
        adv,
        torch.ones(2, 4),
        cfg,
        lp_old=lp_old,
        provenance=prov,
        lp_stand=lp_stand,
        lp_ref=lp_ref,
    )
    loss.backward()
    assert lp_theta.grad is not None and lp_theta.grad.abs().sum() > 0
    for t in (lp_prox, lp_behav, lp_old, lp_stand, lp_ref, adv):
        assert t.grad is None


def test_padding_with_inf_logprobs_stays_finite():
    lp_theta = _t([[-1.0, -math.inf]]).requires_grad_()
    lp = _t([[-1.2, 0.0]])
    cfg = ObjectiveConfig(kl=KLInLoss(coef=0.5))
    loss, _ = decoupled_ppo_loss(
        lp_theta, lp, lp, _t([1.0]), torch.tensor([[1, 0]]), cfg, lp_old=lp, lp_ref=lp
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp_theta.grad).all()


def test_kl_term_in_the_loss():
    lp_behav = _t([[-1.0, -1.0]])
    lp_old = _t([[-0.9, -1.0]])  # r_d = e^0.1 on token 0
    lp_theta = _t([[-1.0, -1.0]])
    lp_ref = _t([[-1.5, -0.5]])
    cfg = ObjectiveConfig(
        correction=TISTokenCorrection(cap=1.05), kl=KLInLoss(coef=0.1, estimator="k3")
    )
    loss, m = decoupled_ppo_loss(
        lp_theta, lp_old, lp_behav, _t([0.0]), torch.ones(1, 2), cfg, lp_old=lp_old, lp_ref=lp_ref
    )
    k3 = lambda lr: math.exp(lr) - 1 - lr
    # weight = c_d · min(r_stale, C_s) · r_t = min(e^0.1, 1.05) · 1 · e^-0.1 on token 0 (prox = old)
    w0 = 1.05 * math.exp(-0.1)
    expected_kl = 0.1 * (w0 * k3(-0.5) + 1.0 * k3(0.5)) / 2
    assert m["kl_loss"] == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(expected_kl)  # A = 0: no policy-gradient term
    with pytest.raises(ValueError, match="lp_ref"):
        decoupled_ppo_loss(
            lp_theta, lp_old, lp_behav, _t([0.0]), torch.ones(1, 2), cfg, lp_old=lp_old
        )


def test_bad_shapes_raise():
    x = torch.zeros(2, 3)
    cfg = ObjectiveConfig()
    with pytest.raises(ValueError, match="lp_behav"):
        decoupled_ppo_loss(x, x, torch.zeros(2, 4), x, torch.ones(2, 3), cfg, lp_old=x)
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss(x, x, x, torch.zeros(3), torch.ones(2, 3), cfg, lp_old=x)
    with pytest.raises(ValueError, match="lp_old"):
        decoupled_ppo_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), cfg, lp_old=torch.zeros(2, 2))

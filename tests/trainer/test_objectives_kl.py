"""KL estimators: Monte Carlo means for Gaussians, importance weighting, reward and loss helpers."""

import math

import pytest
import torch

from cells.trainer.objectives.kl import add_kl_to_rewards, kl_estimate, kl_loss, kl_reward_penalty

torch.set_num_threads(1)

F64 = torch.float64
N = 200_000


def _normal_logpdf(x, mu):
    return -0.5 * (x - mu) ** 2 - 0.5 * math.log(2 * math.pi)


@pytest.mark.parametrize("mu", [0.5, 1.0])
def test_k1_and_k3_means_approach_half_mu_squared(mu):
    # q = N(0, 1) is pi_theta (the sampler), p = N(mu, 1) the reference: KL(q || p) = mu^2 / 2
    x = torch.randn(N, generator=torch.Generator().manual_seed(3), dtype=F64)
    lp_theta, lp_ref = _normal_logpdf(x, 0.0), _normal_logpdf(x, mu)
    k1 = kl_estimate(lp_theta, lp_ref, "k1").mean().item()
    k3 = kl_estimate(lp_theta, lp_ref, "k3").mean().item()
    k2 = kl_estimate(lp_theta, lp_ref, "k2").mean().item()
    assert k1 == pytest.approx(mu**2 / 2, abs=0.01)
    assert k3 == pytest.approx(mu**2 / 2, abs=0.01)
    # k2 is biased: E[½(mu·x − mu²/2)²] = (mu² + mu⁴/4) / 2
    assert k2 == pytest.approx((mu**2 + mu**4 / 4) / 2, abs=0.01)
    assert kl_estimate(lp_theta, lp_ref, "k3").min().item() >= 0.0


def test_importance_weighted_estimates_from_behaviour_samples():
    # samples from pi_behav = N(0.3, 1); the weight pi_theta/pi_behav recovers KL(q || p)
    mu = 1.0
    x = 0.3 + torch.randn(N, generator=torch.Generator().manual_seed(4), dtype=F64)
    lp_theta, lp_ref, lp_behav = (
        _normal_logpdf(x, 0.0),
        _normal_logpdf(x, mu),
        _normal_logpdf(x, 0.3),
    )
    weight = torch.exp(lp_theta - lp_behav)
    for est in ("k1", "k3"):
        k = kl_estimate(lp_theta, lp_ref, est)
        assert (weight * k).mean().item() == pytest.approx(mu**2 / 2, abs=0.02)
    # unweighted, k1 = −mu·x + mu²/2 averages mu²/2 − 0.3·mu: weighting is what fixes it
    assert kl_estimate(lp_theta, lp_ref, "k1").mean().item() == pytest.approx(
        mu**2 / 2 - 0.3 * mu, abs=0.02
    )


def test_hand_values_and_gradient():
    lp_theta = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    lp_ref = torch.tensor([-1.5, -1.0], dtype=F64, requires_grad=True)
    lr = [-0.5, 1.0]  # log rho = lp_ref − lp_theta
    torch.testing.assert_close(
        kl_estimate(lp_theta, lp_ref, "k1"), torch.tensor([0.5, -1.0], dtype=F64)
    )
    torch.testing.assert_close(
        kl_estimate(lp_theta, lp_ref, "k2"), torch.tensor([0.125, 0.5], dtype=F64)
    )
    k3 = kl_estimate(lp_theta, lp_ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([math.exp(v) - 1 - v for v in lr], dtype=F64))
    k3.sum().backward()
    # d k3 / d lp_theta = 1 − rho
    torch.testing.assert_close(
        lp_theta.grad, torch.tensor([1 - math.exp(v) for v in lr], dtype=F64)
    )
    assert lp_ref.grad is None
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp_theta, lp_ref, "k4")


def test_kl_loss_and_reward_helpers():
    lp_theta = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64)
    lp_ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=F64)
    weight = torch.tensor([[0.5, 2.0, 9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1.0]
    loss = kl_loss(lp_theta, lp_ref, weight, mask, coef=0.2)
    assert loss.item() == pytest.approx(0.2 * (0.5 * k3[0] + 2.0 * k3[1]) / 2)
    assert kl_loss(lp_theta, lp_ref, weight, mask, coef=0.2, num_tokens=8).item() == pytest.approx(
        loss.item() / 4
    )
    pen = kl_reward_penalty(lp_theta, lp_ref, weight, mask, coef=0.1)  # k1 = lp − lp_ref
    assert pen.tolist() == pytest.approx([0.1 * (0.5 * 0.5 + 2.0 * -1.0)])
    rewards = torch.tensor([1.0], dtype=F64)
    out = add_kl_to_rewards(rewards, lp_theta, lp_ref, weight, mask, coef=0.1)
    assert out.tolist() == pytest.approx([1.0 - 0.1 * (0.25 - 2.0)])
    assert rewards.item() == 1.0 and not out.requires_grad
    with pytest.raises(ValueError, match="rewards must have shape"):
        add_kl_to_rewards(torch.zeros(2), lp_theta, lp_ref, weight, mask, coef=0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_loss(lp_theta, lp_ref[:, :2], weight, mask, coef=0.1)

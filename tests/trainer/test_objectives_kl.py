"""KL estimators: Monte Carlo means for Gaussians, importance weighting, reward and loss helpers."""

import math

import pytest
import torch

from cells.rl.objectives.kl import add_kl_to_rewards, kl_estimate, kl_loss, kl_reward_penalty

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


# --- the gradient of the KL term in the loss, by exact enumeration -------------------------

V = 6


def _categoricals(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=F64).requires_grad_()
    lp_ref = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)
    lp_behav = torch.log_softmax(torch.randn(V, generator=g, dtype=F64) * 0.5, -1)
    return theta, lp_ref, lp_behav


def _forward_kl_grad(theta, lp_ref):
    lp = torch.log_softmax(theta, -1)
    kl = (lp.exp() * (lp - lp_ref)).sum()  # KL(pi_theta || pi_ref)
    return torch.autograd.grad(kl, theta)[0]


def _expected_grad(theta, lp_ref, lp_behav, term):
    """sum_x pi_behav(x) · grad term(x): the exact expectation over a token x ~ pi_behav of
    the gradient of `term(lp_theta(x), lp_ref(x), weight(x))`, weight = pi_theta/pi_behav."""
    lp = torch.log_softmax(theta, -1)
    expected = sum(
        lp_behav[x].exp() * term(lp[x].view(1, 1), lp_ref[x].view(1, 1),
                                 (lp[x] - lp_behav[x]).exp().detach().view(1, 1))
        for x in range(V)
    )
    return torch.autograd.grad(expected, theta)[0]


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_expected_gradient_is_forward_kl_gradient(estimator, seed):
    theta, lp_ref, lp_behav = _categoricals(seed)

    def term(lp_t, lp_r, w):
        return kl_loss(lp_t, lp_r, w, torch.ones(1, 1), coef=1.0, estimator=estimator)

    got = _expected_grad(theta, lp_ref, lp_behav, term)
    torch.testing.assert_close(got, _forward_kl_grad(theta, lp_ref))


def test_plain_k3_as_a_loss_follows_the_reverse_kl():
    # why kl_loss does not differentiate k3 itself: its expected gradient is grad KL(ref || theta)
    theta, lp_ref, lp_behav = _categoricals(5)

    def plain_k3(lp_t, lp_r, w):
        return (w * kl_estimate(lp_t, lp_r, "k3")).sum()

    got = _expected_grad(theta, lp_ref, lp_behav, plain_k3)
    lp = torch.log_softmax(theta, -1)
    reverse = torch.autograd.grad((lp_ref.exp() * (lp_ref - lp)).sum(), theta)[0]
    torch.testing.assert_close(got, reverse)
    assert not torch.allclose(got, _forward_kl_grad(theta, lp_ref))


def test_kl_loss_reports_k3_value_with_k2_gradient():
    lp_theta = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    lp_ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    loss = kl_loss(lp_theta, lp_ref, torch.ones(1, 2), torch.ones(1, 2), coef=1.0, estimator="k3")
    lr = [-0.5, 1.0]
    assert loss.item() == pytest.approx(sum(math.exp(v) - 1 - v for v in lr) / 2)
    loss.backward()
    # d k2 / d lp_theta = lp_theta − lp_ref = −log rho
    torch.testing.assert_close(lp_theta.grad, torch.tensor([[0.25, -0.5]], dtype=F64))


def test_k1_is_refused_in_the_loss():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="zero expected gradient"):
        kl_loss(x, x, x, torch.ones(1, 2), coef=0.1, estimator="k1")
    from pydantic import ValidationError

    from cells.rl.objectives.config import KLInLoss, KLInReward

    with pytest.raises(ValidationError, match="zero expected gradient"):
        KLInLoss(estimator="k1")
    assert KLInReward(estimator="k1").estimator == "k1"  # k1 belongs in the reward


def test_decoupled_loss_kl_term_expected_gradient_is_forward_kl_gradient():
    # the whole loss with A = 0 (no policy-gradient term): lp_old = lp_behav (r_d = 1),
    # lp_prox = lp_theta detached (first minibatch), so w·r_t = pi_theta/pi_behav.
    from cells.rl.objectives.config import KLInLoss, NoCorrection, ObjectiveConfig
    from cells.rl.objectives.ppo import decoupled_ppo_loss

    theta, lp_ref, lp_behav = _categoricals(7)
    cfg = ObjectiveConfig(correction=NoCorrection(), reject_below=None, staleness_cap=1e6,
                          kl=KLInLoss(coef=1.0, estimator="k3"))

    def term(lp_t, lp_r, w):
        lb = lp_t.detach() - w.log()
        loss, _ = decoupled_ppo_loss(lp_t, lp_t.detach(), lb, torch.zeros(1, dtype=F64),
                                     torch.ones(1, 1), cfg, lp_old=lb, lp_ref=lp_r)
        return loss

    got = _expected_grad(theta, lp_ref, lp_behav, term)
    torch.testing.assert_close(got, _forward_kl_grad(theta, lp_ref))

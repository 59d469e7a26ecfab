"""pi_theta/pi_behav = r_d · r_stale · r_t, and only r_t carries a gradient."""

import pytest
import torch

from cells.rl.objectives.ratios import check_same_shape, log_ratios

torch.set_num_threads(1)


def test_decomposition_identity():
    g = torch.Generator().manual_seed(0)
    lp = [-torch.rand(3, 5, generator=g, dtype=torch.float64) * 3 for _ in range(4)]
    lp_theta, lp_prox, lp_old, lp_behav = lp
    r = log_ratios(lp_theta, lp_prox, lp_old, lp_behav)
    expected = torch.exp(lp_theta - lp_behav)  # pi_theta / pi_behav
    torch.testing.assert_close(r.r_d * r.r_stale * r.r_t, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(r.r_d, torch.exp(lp_old - lp_behav))
    torch.testing.assert_close(r.r_stale, torch.exp(lp_prox - lp_old))
    torch.testing.assert_close(r.r_t, torch.exp(lp_theta - lp_prox))
    torch.testing.assert_close(r.log_total(), lp_theta - lp_behav)


def test_hand_numbers():
    t = lambda x: torch.tensor([x], dtype=torch.float64)
    r = log_ratios(t(-0.5), t(-0.8), t(-0.9), t(-1.0))
    assert r.log_r_d.item() == pytest.approx(0.1)
    assert r.log_r_stale.item() == pytest.approx(0.1)
    assert r.log_r_t.item() == pytest.approx(0.3)


def test_only_lp_theta_has_gradient():
    lps = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    r = log_ratios(*lps)
    (r.r_d * r.r_stale * r.r_t).sum().backward()
    assert lps[0].grad is not None and lps[0].grad.abs().sum() > 0
    assert all(x.grad is None for x in lps[1:])
    assert not r.log_r_d.requires_grad and not r.log_r_stale.requires_grad


def test_shape_mismatch_names_the_tensor():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="lp_prox"):
        log_ratios(a, b, a, a)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        check_same_shape(x=a, y=[1, 2])

"""KL to the reference policy: per-token estimators and where they enter.

With x sampled from pi_theta and log rho = lp_ref − lp_theta:
    k1 = −log rho                 unbiased, high variance
    k2 = ½ (log rho)²             biased
    k3 = rho − 1 − log rho        unbiased, ≥ 0
Our samples come from pi_behav, so each estimate is weighted by the detached, correction-
masked pi_theta/pi_behav (`weight`).

These are estimates of the KL's value. As a loss what matters is the gradient (docs/RL.md):
    weighted k2      expected gradient = grad KL(pi_theta || pi_ref), the direction we want
    weighted k3      expected gradient = grad KL(pi_ref || pi_theta), the reverse KL
    weighted k1      expected gradient = 0
So `kl_loss` optimises k2's gradient whatever it reports: with `k3` its value is k3 and its
gradient k2's (k3.detach() + k2 − k2.detach()); `k1` is refused there and belongs in the
reward (`add_kl_to_rewards`).

`update_kl_terms` measures how far an update moved the policy (KL(pi_prox || pi_new), the
trust-region guard's and the `approx_kl` metric's figure) with the same k3, the ratio taken
the right way up and the samples reweighted to pi_prox.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from cells.rl.objectives.correction import as_bool_mask
from cells.rl.objectives.ratios import check_same_shape

Estimator = Literal["k1", "k2", "k3"]
LossEstimator = Literal["k2", "k3"]
"""Estimators a KL loss term accepts (k1 has zero expected gradient as a loss)."""


def kl_k1(lp_theta: Tensor, lp_ref: Tensor) -> Tensor:
    """k1 = −log rho = lp_theta − lp_ref."""
    return lp_theta - lp_ref


def kl_k2(lp_theta: Tensor, lp_ref: Tensor) -> Tensor:
    """k2 = ½ (lp_ref − lp_theta)²."""
    return 0.5 * (lp_ref - lp_theta).square()


def kl_k3(lp_theta: Tensor, lp_ref: Tensor) -> Tensor:
    """k3 = rho − 1 − log rho with log rho = lp_ref − lp_theta."""
    log_rho = lp_ref - lp_theta
    return log_rho.exp() - 1.0 - log_rho


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(lp_theta: Tensor, lp_ref: Tensor, estimator: Estimator) -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate; the gradient flows through lp_theta only."""
    check_same_shape(lp_theta=lp_theta, lp_ref=lp_ref)
    try:
        fn = _ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of {sorted(_ESTIMATORS)}"
        ) from None
    return fn(lp_theta, lp_ref.detach())


def kl_loss(
    lp_theta: Tensor,
    lp_ref: Tensor,
    weight: Tensor,
    mask: Tensor,
    *,
    coef: float,
    estimator: LossEstimator = "k3",
    num_tokens: Tensor | float | None = None,
) -> Tensor:
    """coef · (1/N0) · sum_t M'·weight·k, with `weight` detached and N0 = sum M by default.

    The value is that of `estimator` (k2 or k3); the gradient is always weighted k2's, whose
    expectation over the samples is grad KL(pi_theta || pi_ref). `k1` raises ValueError: its
    expected gradient is zero, so as a loss it only adds noise (put it in the reward).
    Pass `num_tokens` to use a global N0 (summed over data-parallel ranks).
    """
    if estimator == "k1":
        raise ValueError(
            "k1 has zero expected gradient as a loss term; use k2 or k3 in the loss, "
            "or put k1 in the reward (KLInReward)"
        )
    if estimator not in ("k2", "k3"):
        raise ValueError(f"unknown KL loss estimator {estimator!r}; expected 'k2' or 'k3'")
    check_same_shape(lp_theta=lp_theta, lp_ref=lp_ref, weight=weight, mask=mask)
    m = as_bool_mask(mask, "mask")
    # Zero the log-probs outside M' before exponentiating so garbage there cannot make NaN
    # gradients (0 · inf) through the masked branch.
    lp_t = torch.where(m, lp_theta, 0.0)
    lp_r = torch.where(m, lp_ref.detach(), 0.0)
    k2 = kl_k2(lp_t, lp_r)
    if estimator == "k2":
        k = k2
    else:  # report k3, optimise the forward KL: k3's own gradient is the reverse KL's
        k = kl_k3(lp_t, lp_r).detach() + k2 - k2.detach()
    n0 = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=k.device)
    total = (torch.where(m, weight.detach(), 0.0) * k).sum()
    return coef * total / n0.clamp(min=1)


def kl_reward_penalty(
    lp_policy: Tensor,
    lp_ref: Tensor,
    weight: Tensor,
    mask: Tensor,
    *,
    coef: float,
    estimator: Estimator = "k1",
) -> Tensor:
    """Per-sequence penalty coef · sum_t M·weight·k (B,), detached.

    `lp_policy` is the policy being regularised at reward time (the trainer's parameters at
    the start of the update, lp_prox) and `weight` the detached correction-masked
    pi_policy/pi_behav.
    """
    check_same_shape(lp_policy=lp_policy, lp_ref=lp_ref, weight=weight, mask=mask)
    m = as_bool_mask(mask, "mask")
    k = kl_estimate(torch.where(m, lp_policy.detach(), 0.0), torch.where(m, lp_ref, 0.0), estimator)
    return coef * (torch.where(m, weight.detach(), 0.0) * k).sum(dim=-1)


def add_kl_to_rewards(
    rewards: Tensor,
    lp_policy: Tensor,
    lp_ref: Tensor,
    weight: Tensor,
    mask: Tensor,
    *,
    coef: float,
    estimator: Estimator = "k1",
) -> Tensor:
    """R_i − coef · sum_t M·weight·k for sequence rewards R (B,); returns a new tensor."""
    if rewards.dim() != 1 or rewards.shape[0] != lp_policy.shape[0]:
        raise ValueError(
            f"rewards must have shape ({lp_policy.shape[0]},), got {tuple(rewards.shape)}"
        )
    return rewards - kl_reward_penalty(
        lp_policy, lp_ref, weight, mask, coef=coef, estimator=estimator
    ).to(rewards.dtype)


def update_kl_terms(lp_prox: Tensor, lp_new: Tensor, lp_behav: Tensor, mask: Tensor,
                    cap: float) -> tuple[float, float]:
    """How far an update moved the policy: the parts of the self-normalised importance-sampled
    k3 estimate of KL(pi_prox || pi_new) over masked tokens, (sum w·k3, sum w).

    k3 of KL(pi_prox || pi_new) is r − 1 − log r with r = pi_new/pi_prox (log r = lp_new −
    lp_prox): unbiased and ≥ 0 for tokens drawn from pi_prox (the inverse ratio would estimate
    chi²(pi_prox || pi_new) − KL instead, unbounded for large steps). The tokens were drawn from
    pi_behav, so each is weighted by the detached pi_prox/pi_behav, truncated at `cap` (the
    truncation trades a small bias for bounded variance); the estimate is the weighted mean."""
    check_same_shape(lp_prox=lp_prox, lp_new=lp_new, lp_behav=lp_behav)
    m = as_bool_mask(mask, "mask")
    log_r = torch.where(m, lp_new.detach() - lp_prox, 0.0)
    k3 = log_r.exp() - 1.0 - log_r
    w = torch.where(m, (lp_prox - lp_behav).clamp(max=math.log(cap)).exp(), 0.0).detach()
    return float((w * k3).sum()), float(w.sum())

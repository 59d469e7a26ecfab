"""Decomposition of the off-policy ratio into its three factors.

    pi_theta / pi_behav = r_d · r_stale · r_t
    r_d     = exp(lp_old − lp_behav)    train/inference discrepancy at the behaviour version
    r_stale = exp(lp_prox − lp_old)     staleness up to the start of this update
    r_t     = exp(lp_theta − lp_prox)   the PPO ratio of this update

Only r_t carries a gradient (through lp_theta); r_d and r_stale are built from detached
inputs. For tokens whose lp_old is missing, the anchor is lp_stand from the PPO-EWMA policy
and the same decomposition holds with lp_old replaced by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class LogRatios:
    """Per-token log factors; `log_r_d` and `log_r_stale` are detached."""

    log_r_d: Tensor
    """lp_anchor − lp_behav (lp_anchor = lp_old, or lp_stand where lp_old is missing)."""
    log_r_stale: Tensor
    """lp_prox − lp_anchor."""
    log_r_t: Tensor
    """lp_theta − lp_prox (carries the gradient of lp_theta)."""

    @property
    def r_d(self) -> Tensor:
        return self.log_r_d.exp()

    @property
    def r_stale(self) -> Tensor:
        return self.log_r_stale.exp()

    @property
    def r_t(self) -> Tensor:
        return self.log_r_t.exp()

    def log_total(self) -> Tensor:
        """log(pi_theta / pi_behav) as the sum of the three factors."""
        return self.log_r_d + self.log_r_stale + self.log_r_t


def log_ratios(lp_theta: Tensor, lp_prox: Tensor, lp_anchor: Tensor, lp_behav: Tensor) -> LogRatios:
    """Split log(pi_theta/pi_behav) into (log r_d, log r_stale, log r_t).

    Does not modify its inputs; every input but lp_theta is detached here.
    """
    check_same_shape(lp_theta=lp_theta, lp_prox=lp_prox, lp_anchor=lp_anchor, lp_behav=lp_behav)
    lp_prox, lp_anchor, lp_behav = lp_prox.detach(), lp_anchor.detach(), lp_behav.detach()
    return LogRatios(
        log_r_d=lp_anchor - lp_behav,
        log_r_stale=lp_prox - lp_anchor,
        log_r_t=lp_theta - lp_prox,
    )


def check_same_shape(**tensors: Tensor | None) -> torch.Size:
    """Raise ValueError naming the first tensor whose shape differs from the first one."""
    shape: torch.Size | None = None
    first = ""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if shape is None:
            shape, first = t.shape, name
        elif t.shape != shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(t.shape)}, {first} has {tuple(shape)}"
            )
    if shape is None:
        raise ValueError("no tensors given")
    return shape

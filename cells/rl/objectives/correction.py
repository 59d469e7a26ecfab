"""Train/inference correction c_d(r_d) and the masks it implies.

    rho = exp(clamp(lp_anchor − lp_behav, −20, 20))      per token, lp_anchor = lp_old or lp_stand
    none          c = 1
    tis_token     c = min(rho, C)
    tis_sequence  c = min(exp(sum M·log rho), C)                          (one c per sequence)
    mis_token     c = rho·1[C_lo ≤ rho ≤ C_hi]                            (IcePop)
    mis_sequence  s = exp(sum M·log rho) or exp(mean_M log rho); keep iff s ∈ [C_lo, C_hi], c = s
    reject        drop a sequence with any masked rho < reject_below      (all modes)
    normalise     c ← c / mean_{M'}(c)                                    (optional)

A token leaves the loss mask (M' = M ∧ kept) when MIS rejects it or its sequence, or when
the catastrophic reject drops its sequence. The sequence axis is the last one; rows are
sequences (or, for trees, unrolled branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cells.rl.objectives.config import (
    CorrectionConfig,
    MISSequenceCorrection,
    MISTokenCorrection,
    NoCorrection,
    TISSequenceCorrection,
    TISTokenCorrection,
)
from cells.rl.objectives.ratios import check_same_shape

LOG_RHO_CLAMP = 20.0
"""log rho is clamped to [−20, 20] before exponentiation so that c stays finite."""


@dataclass(frozen=True, slots=True)
class Correction:
    """Result of the correction; every tensor is detached."""

    weight: Tensor
    """c per token, zero where `keep` is False."""
    keep: Tensor
    """M' as a bool tensor: masked by M and kept by every correction mask."""
    rejected: Tensor
    """Bool per sequence: dropped by the catastrophic reject."""
    rho: Tensor
    """exp(clamp(log rho)) per token (1 outside M)."""


def apply_correction(
    log_rho: Tensor,
    mask: Tensor,
    mode: CorrectionConfig,
    *,
    reject_below: float | None = 1e-4,
    self_normalize: bool = False,
    normalizer: Tensor | float | None = None,
) -> Correction:
    """Compute c and M' from per-token log rho (B, T) and the loss mask M (B, T).

    `normalizer`, when given with `self_normalize`, replaces the local mean_{M'}(c), e.g. by a
    mean gathered over data-parallel ranks. Does not modify its inputs.
    """
    check_same_shape(log_rho=log_rho, mask=mask)
    if log_rho.dim() != 2:
        raise ValueError(
            f"log_rho must be 2-D (sequences, tokens), got shape {tuple(log_rho.shape)}"
        )
    m = as_bool_mask(mask, "mask")
    # NaN or garbage outside M must not leak into sequence sums.
    log_rho = torch.where(m, log_rho.detach().clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP), 0.0)
    rho = log_rho.exp()
    keep = m.clone()

    if isinstance(mode, NoCorrection):
        c = torch.ones_like(rho)
    elif isinstance(mode, TISTokenCorrection):
        c = rho.clamp(max=mode.cap)
    elif isinstance(mode, TISSequenceCorrection):
        seq_log = log_rho.sum(dim=-1, keepdim=True)
        c = seq_log.clamp(max=math.log(mode.cap)).exp().expand_as(rho)
    elif isinstance(mode, MISTokenCorrection):
        inside = (rho >= mode.low) & (rho <= mode.high)
        c = rho
        keep &= inside
    elif isinstance(mode, MISSequenceCorrection):
        seq_log = log_rho.sum(dim=-1, keepdim=True)
        if mode.statistic == "geometric_mean":
            seq_log = seq_log / m.sum(dim=-1, keepdim=True).clamp(min=1)
        s = seq_log.exp()  # may be inf for a wild product; inf is outside the bounds
        inside = (s >= mode.low) & (s <= mode.high)
        c = s.expand_as(rho)
        keep &= inside
    else:
        raise ValueError(f"unknown correction mode {mode!r}")

    if reject_below is not None:
        rejected = ((rho < reject_below) & m).any(dim=-1)
        keep &= ~rejected.unsqueeze(-1)
    else:
        rejected = torch.zeros(rho.shape[0], dtype=torch.bool, device=rho.device)

    c = torch.where(keep, c, 0.0)
    if self_normalize:
        c = normalize_weights(c, keep, normalizer)
    return Correction(weight=c, keep=keep, rejected=rejected, rho=rho)


def normalize_weights(weight: Tensor, keep: Tensor, mean: Tensor | float | None = None) -> Tensor:
    """c ← c / mean_{M'}(c); unchanged when nothing is kept or the mean is zero."""
    if mean is None:
        num = keep.sum()
        mean = torch.where(num > 0, weight.sum() / num.clamp(min=1), 1.0)
    mean = torch.as_tensor(mean, dtype=weight.dtype, device=weight.device)
    safe = torch.where(mean > 0, mean, 1.0)
    return weight / safe


def as_bool_mask(mask: Tensor, name: str) -> Tensor:
    """A 0/1 (bool, int or float) mask as a bool tensor; other values raise ValueError."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name} must be a bool or 0/1 tensor, got dtype {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1")
    return mask != 0

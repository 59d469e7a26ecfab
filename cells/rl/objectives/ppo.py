"""The decoupled PPO loss with train/inference correction and staleness weights.

    L = −(1/N0) · sum_t M'_t · w_t · min(r_t·A_t, clip(r_t, 1−eps, 1+eps_hi)·A_t)
    w_t = c_d(exp(lp_old − lp_behav)) · min(exp(lp_prox − lp_old), C_s)       exact lp_old
    w_t = c_d(exp(lp_stand − lp_behav)) · min(exp(lp_prox − lp_stand), C_s)   lp_old missing
    N0  = sum of M before any rejection (pass the sum over data-parallel ranks)

Optional dual clip c > 1 caps the per-token loss at c·|A| for A < 0. Everything but lp_theta
is detached. Provenance says per token whether lp_old is exact or missing; missing tokens
use lp_stand from the PPO-EWMA policy and are never counted as exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cells.rl.objectives.config import KLInLoss, ObjectiveConfig
from cells.rl.objectives.correction import Correction, apply_correction, as_bool_mask
from cells.rl.objectives.custom import LossInputs, custom_pg_loss
from cells.rl.objectives.kl import kl_estimate, kl_loss
from cells.rl.objectives.ratios import check_same_shape

PROVENANCE_EXACT = 0
"""Provenance code: lp_old was scored exactly at the behaviour version."""
PROVENANCE_MISSING = 1
"""Provenance code: lp_old is missing; lp_stand from the PPO-EWMA policy stands in."""


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """Detached per-token weights of the loss (everything except r_t)."""

    weight: Tensor
    """w_t = c_d · min(r_stale, C_s), zero outside `keep`."""
    keep: Tensor
    """M' (bool): masked by M and kept by the correction masks."""
    missing: Tensor
    """Bool: lp_old missing for this token (lp_stand used)."""
    log_r_d: Tensor
    """lp_anchor − lp_behav (zero outside M)."""
    log_r_stale: Tensor
    """lp_prox − lp_anchor (zero outside M)."""
    correction: Correction
    """The correction result (c, M', rejected sequences, rho)."""


def missing_from_provenance(provenance: Tensor | None, shape: torch.Size) -> Tensor | None:
    """Provenance (bool: True = missing, or int codes 0 exact / 1 missing) as a bool tensor."""
    if provenance is None:
        return None
    if provenance.shape != shape:
        raise ValueError(
            f"shape mismatch: provenance has shape {tuple(provenance.shape)}, expected {tuple(shape)}"
        )
    if provenance.dtype == torch.bool:
        return provenance
    if provenance.is_floating_point() or provenance.is_complex():
        raise ValueError(
            f"provenance must be a bool or integer tensor, got dtype {provenance.dtype}"
        )
    known = (provenance == PROVENANCE_EXACT) | (provenance == PROVENANCE_MISSING)
    if not bool(known.all()):
        raise ValueError(
            f"unknown provenance code; expected {PROVENANCE_EXACT} (exact) or {PROVENANCE_MISSING} (missing)"
        )
    return provenance == PROVENANCE_MISSING


def token_weights(
    lp_prox: Tensor,
    lp_behav: Tensor,
    mask: Tensor,
    cfg: ObjectiveConfig,
    *,
    lp_old: Tensor | None = None,
    provenance: Tensor | None = None,
    lp_stand: Tensor | None = None,
    normalizer: Tensor | float | None = None,
) -> TokenWeights:
    """w_t and M' for tokens (B, T). Without `provenance` every token is exact.

    Values of lp_old at missing tokens (and of lp_stand at exact ones) are ignored; they may
    be NaN. `normalizer` replaces the local self-normalisation mean (see `apply_correction`).
    """
    shape = check_same_shape(
        lp_prox=lp_prox, lp_behav=lp_behav, mask=mask, lp_old=lp_old, lp_stand=lp_stand
    )
    if len(shape) != 2:
        raise ValueError(f"token tensors must be 2-D (sequences, tokens), got shape {tuple(shape)}")
    m = as_bool_mask(mask, "mask")
    missing = missing_from_provenance(provenance, shape)
    if missing is None:
        missing = torch.zeros(shape, dtype=torch.bool, device=lp_prox.device)
    any_missing = bool((missing & m).any())
    any_exact = bool((~missing & m).any())
    if any_missing and lp_stand is None:
        raise ValueError(
            "tokens with missing lp_old need lp_stand (log-probs under the PPO-EWMA policy)"
        )
    if any_exact and lp_old is None:
        raise ValueError("lp_old is required for tokens whose provenance is exact")

    if lp_old is None:
        anchor = lp_stand.detach()
    elif lp_stand is None:
        anchor = lp_old.detach()
    else:
        anchor = torch.where(missing, lp_stand.detach(), lp_old.detach())
    anchor = torch.where(m, anchor, 0.0)
    prox = torch.where(m, lp_prox.detach(), 0.0)
    behav = torch.where(m, lp_behav.detach(), 0.0)
    log_r_d = anchor - behav
    log_r_stale = prox - anchor

    corr = apply_correction(
        log_r_d,
        m,
        cfg.correction,
        reject_below=cfg.reject_below,
        self_normalize=cfg.self_normalize,
        normalizer=normalizer,
    )
    stale = log_r_stale.clamp(max=math.log(cfg.staleness_cap)).exp()
    w = torch.where(corr.keep, corr.weight * stale, 0.0)
    return TokenWeights(w, corr.keep, missing, log_r_d, log_r_stale, corr)


def ppo_objective(
    r_t: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token min(r·A, clip(r)·A), with dual clip max(·, c·A) for A < 0.

    Returns (objective, clipped, dual_clipped); the two bool tensors say which bound is active.
    """
    unclipped = r_t * advantages
    clipped = r_t.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    obj = torch.minimum(unclipped, clipped)
    is_clipped = clipped < unclipped
    is_dual = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        floor = dual_clip * advantages
        is_dual = (advantages < 0) & (floor > obj)
        obj = torch.where(is_dual, floor, obj)
    return obj, is_clipped & ~is_dual, is_dual


def decoupled_ppo_loss(
    lp_theta: Tensor,
    lp_prox: Tensor,
    lp_behav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: ObjectiveConfig,
    *,
    lp_old: Tensor | None = None,
    provenance: Tensor | None = None,
    lp_stand: Tensor | None = None,
    lp_ref: Tensor | None = None,
    num_tokens: Tensor | float | None = None,
    normalizer: Tensor | float | None = None,
    token_scale: Tensor | None = None,
    seq_index: Tensor | None = None,
    versions_behind: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The decoupled PPO loss over tokens (B, T) and its metrics; gradients only through lp_theta.

    `advantages`: (B,) per sequence or (B, T) per token. `num_tokens`: N0 (default the local
    sum of M; pass the sum over data-parallel ranks). `token_scale` (B, T): each token's
    coefficient in place of 1/N0 (the sequence-level `loss_agg`). `seq_index` (B,): each row's
    sequence, over whose rows the sequence ratio is taken (default: each row its own).
    `versions_behind` only reaches a custom loss (`objective.loss`). With `KLInLoss`, `lp_ref`
    is required and coef·k (a token mean over N0) is added; with `lp_ref` alone it is reported.
    """
    check_same_shape(lp_theta=lp_theta, lp_prox=lp_prox, lp_behav=lp_behav, mask=mask, lp_ref=lp_ref)
    adv = _token_advantages(advantages, lp_theta.shape)
    tw = token_weights(lp_prox, lp_behav, mask, cfg, lp_old=lp_old, provenance=provenance, lp_stand=lp_stand,
                       normalizer=normalizer)
    keep = tw.keep
    m = as_bool_mask(mask, "mask")
    # Zero log r_t outside M' before exp: padding log-probs may be -inf, and 0·inf in the
    # backward of the unselected branch would give NaN gradients.
    log_r_t = torch.where(keep, lp_theta - lp_prox.detach(), 0.0)
    if cfg.ratio == "sequence":
        log_r_t = torch.where(keep, sequence_log_ratio(log_r_t, keep, seq_index), 0.0)
    r_t = log_r_t.exp()
    obj, is_clipped, is_dual = ppo_objective(r_t, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)

    n0 = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=lp_theta.device)
    n0 = n0.to(lp_theta.dtype).clamp(min=1)
    scale = (1.0 / n0) if token_scale is None else token_scale.detach().to(lp_theta.dtype)
    if cfg.loss is not None:
        pg_loss, extra = _custom_loss(cfg, lp_theta, lp_prox, lp_behav, adv, m, tw, scale, log_r_t, versions_behind)
    else:
        pg_loss, extra = -(torch.where(keep, tw.weight * obj, 0.0) * scale).sum(), {}

    kl_term, kl_mean = _kl_terms(lp_theta, lp_ref, tw.weight, r_t, keep, cfg, n0, pg_loss)
    loss = pg_loss + kl_term
    metrics = _metrics(loss, pg_loss, kl_term, kl_mean, tw, m, r_t, is_clipped, is_dual, cfg.ewma_band())
    metrics.update({k: float(v) for k, v in extra.items()})
    return loss, metrics


def _custom_loss(cfg: ObjectiveConfig, lp_theta: Tensor, lp_prox: Tensor, lp_behav: Tensor, adv: Tensor,
                 m: Tensor, tw: TokenWeights, scale: Tensor | float, log_r_t: Tensor,
                 versions_behind: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured loss of one's own on this micro-batch (cells/rl/objectives/custom.py)."""
    keep = tw.keep
    return custom_pg_loss(cfg.loss, LossInputs(
        lp_theta=lp_theta, lp_prox=lp_prox.detach(), lp_behav=lp_behav.detach(),
        lp_old=torch.where(m, lp_behav.detach() + tw.log_r_d, 0.0), missing=tw.missing & m,
        advantages=adv.detach(), mask=m, keep=keep, weight=tw.weight.detach(),
        scale=torch.where(keep, torch.as_tensor(scale, dtype=lp_theta.dtype), 0.0).expand_as(lp_theta),
        log_ratio=log_r_t, versions_behind=versions_behind, cfg=cfg))


def sequence_log_ratio(log_r: Tensor, keep: Tensor, seq_index: Tensor | None) -> Tensor:
    """GSPO's log s per token: the mean of log r_t over each sequence's kept tokens (a
    sequence spanning several rows when `seq_index` says so), broadcast back to its tokens."""
    rows = log_r.shape[0]
    seq = torch.arange(rows, device=log_r.device) if seq_index is None else seq_index.to(log_r.device)
    n = int(seq.max()) + 1 if rows else 0
    sums = log_r.new_zeros(n).index_add(0, seq, torch.where(keep, log_r, 0.0).sum(1))
    counts = log_r.new_zeros(n).index_add(0, seq, keep.sum(1).to(log_r.dtype))
    return (sums / counts.clamp(min=1))[seq].unsqueeze(1).expand_as(log_r)


def _kl_terms(
    lp_theta: Tensor,
    lp_ref: Tensor | None,
    weight: Tensor,
    r_t: Tensor,
    keep: Tensor,
    cfg: ObjectiveConfig,
    n0: Tensor,
    pg_loss: Tensor,
) -> tuple[Tensor, Tensor]:
    """(the KL term of the loss, the reported weighted mean KL), zeros of `pg_loss`'s dtype
    without `lp_ref`; the KL term is zero unless the config puts it in the loss."""
    kl_term = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    kl_mean = torch.zeros_like(kl_term)
    if isinstance(cfg.kl, KLInLoss) and lp_ref is None:
        raise ValueError("a KL term in the loss needs lp_ref")
    if lp_ref is None:
        return kl_term, kl_mean
    # the samples come from pi_behav: weight by the detached, correction-masked
    # pi_theta/pi_behav = w · r_t.
    kl_weight = (weight * r_t).detach()
    if isinstance(cfg.kl, KLInLoss):
        kl_term = kl_loss(
            lp_theta,
            lp_ref,
            kl_weight,
            keep,
            coef=cfg.kl.coef,
            estimator=cfg.kl.estimator,
            num_tokens=n0,
        )
    with torch.no_grad():
        est = "k3" if cfg.kl is None else cfg.kl.estimator
        k = kl_estimate(torch.where(keep, lp_theta, 0.0), torch.where(keep, lp_ref, 0.0), est)
        kl_mean = _masked_mean(kl_weight * k, keep)
    return kl_term, kl_mean


def _token_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    if advantages.shape == shape:
        return advantages.detach()
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.detach().unsqueeze(-1).expand(shape)
    raise ValueError(
        f"advantages must have shape ({shape[0]},) or {tuple(shape)}, got {tuple(advantages.shape)}"
    )


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


@torch.no_grad()
def _metrics(
    loss, pg_loss, kl_term, kl_mean, tw: TokenWeights, m, r_t, is_clipped, is_dual, band
) -> dict[str, float]:
    keep, missing = tw.keep, tw.missing
    exact_m, missing_m = m & ~missing, m & missing
    r_d = tw.correction.rho  # clamped, so the mean stays finite
    # The PPO-EWMA reset rule's count: missing tokens whose exp(lp_stand − lp_behav) lies in
    # the band, whatever the correction mode did with them.
    in_band = missing_m & (r_d >= band[0]) & (r_d <= band[1])
    r_stale = tw.log_r_stale.clamp(max=20.0).exp()
    num_m = m.sum()
    values = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl_loss": kl_term,
        "kl": kl_mean,
        "mean_r_d": _masked_mean(r_d, exact_m),
        "mean_r_stale": _masked_mean(r_stale, exact_m),
        "mean_r_d_missing": _masked_mean(r_d, missing_m),
        "mean_r_stale_missing": _masked_mean(r_stale, missing_m),
        "mean_r_t": _masked_mean(r_t, keep),
        "mean_weight": _masked_mean(tw.weight, keep),
        "frac_masked": 1.0 - keep.sum() / num_m.clamp(min=1),
        "frac_seq_rejected": tw.correction.rejected.float().mean(),
        "clip_frac": _masked_mean(is_clipped.float(), keep),
        "dual_clip_frac": _masked_mean(is_dual.float(), keep),
        "num_tokens": num_m,
        "num_kept": keep.sum(),
        "num_exact": exact_m.sum(),
        "num_missing": missing_m.sum(),
        "num_missing_kept": (keep & missing).sum(),
        "num_missing_in_band": in_band.sum(),
    }
    values = {k: v.detach().to(torch.float64) for k, v in values.items()}
    floats = torch.stack(list(values.values())).tolist()  # one device sync
    out = dict(zip(values.keys(), floats, strict=True))
    out["frac_missing_kept"] = (
        out["num_missing_kept"] / out["num_missing"] if out["num_missing"] else 1.0
    )
    out["frac_missing_in_band"] = (
        out["num_missing_in_band"] / out["num_missing"] if out["num_missing"] else 1.0
    )
    return out


def agg_scale(cfg: ObjectiveConfig, seq_len: Tensor, s0: int) -> Tensor | None:
    """Each row's coefficient (rows, 1) under a sequence-level `loss_agg` (None: `token_mean`,
    1/N0): 1/(S·|seq|) or 1/(S·constant), S counted over all ranks by the plan."""
    if cfg.loss_agg == "token_mean":
        return None
    s = float(max(s0, 1))
    if cfg.loss_agg == "seq_mean_token_mean":
        return (1.0 / (s * seq_len.clamp(min=1.0))).unsqueeze(1)
    return torch.full((seq_len.shape[0], 1), 1.0 / (s * cfg.loss_agg_constant))

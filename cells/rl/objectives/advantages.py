"""Group-relative advantages: one scalar per response, the same for all of its tokens.

    GRPO  A_i = (R_i − mean_G R) / (std_G R + eps),  std Bessel-corrected (n − 1)
    RLOO  A_i = R_i − (sum_j R_j − R_i) / (n − 1)

Every group needs n ≥ 2. Rewards come either as a (groups, n) matrix or as a flat (B,)
vector with a group id per response (groups may then differ in size).

A tree rollout is one member of its group with one reward per branch (`member_advantages`):
the group's statistics are over its members, a member's reward the mean of its branches'.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cells.rl.objectives.config import AdvantageConfig, GRPOAdvantage, RLOOAdvantage
from cells.rl.objectives.correction import as_bool_mask


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6, norm: str = "group_std"
) -> Tensor:
    """GRPO advantages, same shape as `rewards` (`norm="none"`: centred only, Dr. GRPO)."""
    flat, inverse, counts = _groups(rewards, group_ids)
    n = counts[inverse].to(flat.dtype)
    mean = _group_sum(flat, inverse, counts)[inverse] / n
    centred = flat - mean
    if norm == "none":
        return centred.reshape(rewards.shape)
    var = _group_sum(centred.square(), inverse, counts)[inverse] / (n - 1)
    return (centred / (var.sqrt() + eps)).reshape(rewards.shape)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """RLOO advantages (reward minus the mean of the others), same shape as `rewards`."""
    flat, inverse, counts = _groups(rewards, group_ids)
    n = counts[inverse].to(flat.dtype)
    total = _group_sum(flat, inverse, counts)[inverse]
    return (flat - (total - flat) / (n - 1)).reshape(rewards.shape)


def compute_advantages(
    rewards: Tensor, cfg: AdvantageConfig, group_ids: Tensor | None = None, norm: str = "group_std"
) -> Tensor:
    """Dispatch on the configured estimator (`norm`: `objective.advantage_norm`, GRPO's)."""
    if isinstance(cfg, GRPOAdvantage):
        return grpo_advantages(rewards, group_ids, eps=cfg.eps, norm=norm)
    if isinstance(cfg, RLOOAdvantage):
        return rloo_advantages(rewards, group_ids)
    raise ValueError(f"unknown advantage estimator {cfg!r}")


def member_advantages(
    rewards: Tensor, cfg: AdvantageConfig, group_ids: Tensor, member_ids: Tensor, norm: str = "group_std"
) -> Tensor:
    """One advantage per branch (B,) when a member (one rollout) may hold several branches,
    each with its own reward. The group's statistics are over its members, R_m being the mean
    of member m's branch rewards; each branch b of member m is centred (GRPO: and scaled) by
    them:

        GRPO  A_b = (R_b − mean_G R_m) / (std_G R_m + eps)
        RLOO  A_b = R_b − (sum_{j != m} R_j) / (n − 1)      (n = members of the group)

    With `norm="none"` GRPO's A_b is only centred (Dr. GRPO). With one branch per member this
    is `compute_advantages`. Every group needs two members.
    """
    flat = rewards.reshape(-1).to(torch.float64)
    _, m_inv, m_counts = torch.unique(member_ids.reshape(-1), return_inverse=True, return_counts=True)
    r_m = torch.zeros(len(m_counts), dtype=flat.dtype).index_add_(0, m_inv, flat) / m_counts
    g_of_m = torch.zeros(len(m_counts), dtype=torch.long).scatter_(0, m_inv, group_ids.reshape(-1).long())
    r_m, g_inv, g_counts = _groups(r_m, g_of_m)
    n = g_counts[g_inv].to(flat.dtype)
    total = _group_sum(r_m, g_inv, g_counts)[g_inv]
    if isinstance(cfg, GRPOAdvantage):
        mean = total / n
        out = flat - mean[m_inv]
        if norm == "group_std":
            var = _group_sum((r_m - mean).square(), g_inv, g_counts)[g_inv] / (n - 1)
            out = out / (var.sqrt() + cfg.eps)[m_inv]
    elif isinstance(cfg, RLOOAdvantage):
        out = flat - ((total - r_m) / (n - 1))[m_inv]
    else:
        raise ValueError(f"unknown advantage estimator {cfg!r}")
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype())


def expand_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """(B,) advantages to (B, T) tokens: A_i on masked tokens of response i, 0 elsewhere."""
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must be (B,) and (B, T)"
        )
    m = as_bool_mask(mask, "mask")
    return torch.where(m, advantages.unsqueeze(-1), 0.0).to(advantages.dtype)


def _groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Flat float rewards, each response's group index, and the size of every group."""
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(
                f"rewards must be (groups, n), or (B,) with group_ids; got shape {tuple(rewards.shape)}"
            )
        g, n = rewards.shape
        ids = torch.arange(g, device=rewards.device).repeat_interleave(n)
    else:
        if rewards.dim() != 1 or group_ids.shape != rewards.shape:
            raise ValueError(
                f"with group_ids, rewards and group_ids must both be (B,); "
                f"got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
            )
        ids = group_ids
    if rewards.numel() == 0:
        raise ValueError("no rewards given")
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    small = counts < 2
    if bool(small.any()):
        bad = uniq[small].tolist()
        raise ValueError(f"every group needs n >= 2 responses; groups {bad[:8]} have fewer")
    return rewards.reshape(-1), inverse.reshape(-1), counts


def _group_sum(values: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    out = torch.zeros(counts.shape[0], dtype=values.dtype, device=values.device)
    return out.index_add_(0, inverse, values)

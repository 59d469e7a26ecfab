"""The tree side of one RL update: what cells/rl/update.py does for a row, for a tree.

One line: detached forwards over the serialised tree at the update's start (lp_prox, the EWMA
stand-in, the reference) → one advantage per kept branch (task advantage − beta·KL of that
branch when the KL is in the reward) → per minibatch: the tree's forward with gradient and
`tree_ppo_loss`, normalised by the minibatch's global N0 (which counts (branch, token) pairs).

A token on |S(t)| kept branches enters the loss |S(t)| times, each with its branch's
advantage: the loss equals the decoupled PPO loss of the unrolled branches (token mean over
all their tokens); the forward runs once over the serialised tree (docs/RL.md, trees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cells.rl.objectives import (
    KLInReward,
    apply_correction,
    kl_reward_penalty,
    token_weights,
    tree_ppo_loss,
    update_kl_terms,
)
from cells.rl.objectives.ppo import agg_scale
from cells.rl.trees import TreeUnit


@dataclass
class TreeStart:
    """The detached tensors of one tree at the update's start."""

    lp_prox: Tensor
    lp_stand: Tensor
    lp_ref: Tensor | None
    adv: Tensor
    """(branches,): each kept branch's advantage."""
    minibatch: int


def _per_branch(u: TreeUnit, t: Tensor) -> Tensor:
    return t.unsqueeze(0).expand(u.num_branches, t.shape[0])


def start_trees(learner: Any, trees: list[TreeUnit], advantages: list[float], minibatch: list[int]
                ) -> list[TreeStart]:
    """lp_prox, lp_stand (where lp_old is missing), lp_ref (with a KL) and the branch
    advantages of every tree; `advantages` / `minibatch` are per trajectory of the share."""
    cfg, out = learner.objective, []
    for u in trees:
        lp_prox = learner.tree_logprobs(learner.params, u.ser, False)[0]
        lp_stand = torch.zeros_like(u.behav)
        if bool(u.missing.any()):
            lp_stand = learner.tree_logprobs(learner.ewma.params, u.ser, False)[0]
        lp_ref = learner.tree_logprobs(learner.reference, u.ser, False)[0] if cfg.kl is not None else None
        adv = torch.tensor([advantages[i] for i in u.branch_trajs], dtype=torch.float32)
        if isinstance(cfg.kl, KLInReward):  # after the group normalisation, per branch (docs/RL.md)
            adv = adv - _kl_penalty(cfg, u, lp_prox, lp_stand, lp_ref).to(adv.dtype)
        out.append(TreeStart(lp_prox, lp_stand, lp_ref, adv, minibatch[u.branch_trajs[0]]))
    return out


def _kl_penalty(cfg: Any, u: TreeUnit, lp_prox: Tensor, lp_stand: Tensor, lp_ref: Tensor) -> Tensor:
    """beta·KL of each kept branch (its masked tokens), as `update.py` subtracts it per row."""
    prox, lp_ref_b = _per_branch(u, lp_prox), _per_branch(u, lp_ref)
    w = token_weights(prox, _per_branch(u, u.behav), u.mask, cfg, lp_old=_per_branch(u, u.old),
                      provenance=_per_branch(u, u.missing), lp_stand=_per_branch(u, lp_stand)).weight
    return kl_reward_penalty(prox, lp_ref_b, w, u.mask, coef=cfg.kl.coef, estimator=cfg.kl.estimator)


def tree_loss(learner: Any, u: TreeUnit, s: TreeStart, lp_theta: Tensor, n0: Tensor,
              normalizer: Tensor | None, s0: int = 0) -> tuple[Tensor, dict[str, float]]:
    """The tree's share of its minibatch's loss (normalised by the global N0, or under a
    sequence-level aggregation by S and each branch's tokens) and its metrics (counting
    (branch, token) pairs). Its sequences are its branches."""
    scale = agg_scale(learner.objective, u.mask.sum(1).to(torch.float32), s0)
    return tree_ppo_loss(u.ser, lp_theta, s.lp_prox, u.behav, s.adv, learner.objective, lp_old=u.old,
                         provenance=u.missing, lp_stand=s.lp_stand, lp_ref=s.lp_ref, num_pairs=n0,
                         normalizer=normalizer, token_scale=scale,
                         versions_behind=torch.where(u.ser.loss_mask, learner.version - u.versions, -1))


def approx_kl_sum(u: TreeUnit, s: TreeStart, lp_theta: Tensor, cap: float) -> tuple[float, float]:
    """The tree's `update_kl_terms` of KL(pi_prox || pi) over its masked (branch, token) pairs."""
    return update_kl_terms(_per_branch(u, s.lp_prox), _per_branch(u, lp_theta), _per_branch(u, u.behav), u.mask,
                           cap)


def correction_sums(cfg: Any, u: TreeUnit, s: TreeStart) -> Tensor:
    """(sum of the kept correction weights, kept pairs): the tree's part of the minibatch's
    self-normalisation mean."""
    anchor = torch.where(u.missing, s.lp_stand, u.old)
    log_rho = torch.where(u.mask, _per_branch(u, anchor - u.behav), 0.0)
    corr = apply_correction(log_rho, u.mask, cfg.correction, reject_below=cfg.reject_below)
    return torch.stack([corr.weight.sum(), corr.keep.sum()]).to(torch.float64)


def batch_counts(u: TreeUnit, s: TreeStart, version: int) -> tuple[Tensor, float]:
    """The tree's part of the update's provenance and staleness counts, over its serialised
    sampled tokens (each once): (exact, missing, unscored, staleness sum, sampled, lp_prox ==
    lp_old bitwise, |A| sum, branches), and its largest staleness (−1e9: none)."""
    m = u.ser.loss_mask
    exact = m & ~u.missing
    stale = (version - u.versions)[m].to(torch.float64)
    counts = torch.tensor([float(exact.sum()), float((u.missing & ~u.unscored).sum()), float(u.unscored.sum()),
                           float(stale.sum()), float(stale.numel()), float((s.lp_prox == u.old)[exact].sum()),
                           float(s.adv.abs().sum()), float(u.num_branches)], dtype=torch.float64)
    return counts, float(stale.max()) if stale.numel() else -1e9

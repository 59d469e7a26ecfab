"""The coordinator's plan of one RL update: what every rank computes, decided without a forward.

One line: usable trajectories → task advantages by group → minibatches (token-balanced,
contiguous) → each minibatch split across the ranks by token shares → one JSON share per rank.

The unit of all of it is the member (one rollout): a forked episode's branch sessions are one
member of their group (its reward for the group statistics is the mean of its branches', each
branch keeps its own advantage), stay together in one minibatch on one rank, and count their
(branch, token) pairs in N0 (cells/rl/trees.py).

The update must not depend on how many cells train, so everything that needs the whole batch
is decided here, once: the group statistics of the advantages (the task reward only; a KL
penalty is subtracted per sequence on the ranks, after the normalisation, docs/RL.md), which trajectory lands in which minibatch, and each minibatch's global token
count N0 (the loss normaliser, a sum over all ranks' tokens). A rank then only needs its own
trajectories. Pure: no I/O, no torch beyond the advantage arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cells.rl.batch import segments, usable
from cells.rl.objectives import ObjectiveConfig, member_advantages
from cells.rl.objectives.config import TreeConfig
from cells.rl.trees import build_tree, is_tree, members

WIRE_KEYS = ("id", "reward", "group_id", "segment_starts", "token_ids", "loss_mask", "logprobs",
             "versions", "old_logprobs", "provenance")
"""The trajectory fields a rank reads (the rest of the store's record stays home)."""


@dataclass
class Share:
    """One rank's part of an update: its trajectories (in batch order) with their task
    advantage and minibatch, and the global N0 of every minibatch."""

    trajectories: list[dict[str, Any]]
    advantages: list[float]
    minibatch: list[int]
    n0: list[int]
    staleness_bound: int | None = None
    """The bound the plan applied: the rank checks its trajectories against it again."""
    s0: list[int] = field(default_factory=list)
    """Sequences of every minibatch over all ranks (S of the sequence-level aggregations)."""

    @property
    def num_minibatches(self) -> int:
        return len(self.n0)

    def to_json(self) -> dict[str, Any]:
        return {"trajectories": [{k: t.get(k) for k in WIRE_KEYS} for t in self.trajectories],
                "advantages": self.advantages, "minibatch": self.minibatch, "n0": self.n0,
                "staleness_bound": self.staleness_bound, "s0": self.s0}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Share:
        bound = d.get("staleness_bound")
        return cls(list(d["trajectories"]), [float(a) for a in d["advantages"]],
                   [int(m) for m in d["minibatch"]], [int(n) for n in d["n0"]],
                   None if bound is None else int(bound), [int(n) for n in d.get("s0") or ()])


@dataclass
class UpdatePlan:
    shares: list[Share]
    num_trajectories: int
    num_dropped: int
    tokens: list[int] = field(default_factory=list)
    """Masked tokens per member ((branch, token) pairs for a tree), in N0's units."""
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    stale_tokens_dropped: int = 0
    """Sampled tokens past the staleness bound, left out of the loss."""

    def metrics(self) -> dict[str, float]:
        r = torch.tensor(self.rewards, dtype=torch.float32)
        a = torch.tensor(self.advantages, dtype=torch.float32)
        return {"reward_mean": float(r.mean()), "reward_std": float(r.std()) if len(r) > 1 else 0.0,
                "adv_abs_mean": float(a.abs().mean()), "num_trajectories": float(self.num_trajectories),
                "num_dropped": float(self.num_dropped), "num_minibatches": float(self.shares[0].num_minibatches),
                "stale_tokens_dropped": float(self.stale_tokens_dropped)}


def mask_stale(trajectories: Sequence[dict[str, Any]], version: int, bound: int | None
               ) -> tuple[list[dict[str, Any]], int]:
    """The staleness bound where it is trained: a sampled token from more than `bound` versions
    before `version` (the update's proximal policy) leaves the loss (its loss mask becomes 0).
    A partly stale multi-turn session trains only its tokens within the bound; its reward still
    counts in its group's advantage (the group stays whole). Returns the trajectories (copies
    where a token changed) and how many sampled tokens left the loss. `bound` None: no check
    (the `correct` policy: stale tokens train with their correction weights)."""
    if bound is None:
        return list(trajectories), 0
    out, dropped = [], 0
    oldest = version - bound
    for t in trajectories:
        stale = [i for i, (m, v) in enumerate(zip(t["loss_mask"], t["versions"], strict=True))
                 if m and v is not None and v < oldest]
        if stale:
            mask = list(t["loss_mask"])
            for i in stale:
                mask[i] = 0
            t = {**t, "loss_mask": mask}
            dropped += len(stale)
        out.append(t)
    return out, dropped


def masked_tokens(t: dict[str, Any]) -> int:
    """Tokens of `t` that enter the loss (its segments' sampled tokens but the first of each)."""
    return sum(int(s["mask"].sum()) for s in segments(0, t))


def member_sequences(trajs: Sequence[dict[str, Any]], idx: list[int], tree: TreeConfig) -> int:
    """What a member adds to S (the sequence-level aggregations' count): a tree's kept
    branches with a token in the loss, else its trajectories with one."""
    if is_tree([trajs[i] for i in idx]):
        return build_tree(trajs, idx, tree).num_sequences()
    return sum(1 for i in idx if masked_tokens(trajs[i]) > 0)


def member_tokens(trajs: Sequence[dict[str, Any]], idx: list[int], tree: TreeConfig) -> int:
    """What a member adds to N0: a tree's masked (branch, token) pairs, else its tokens."""
    if is_tree([trajs[i] for i in idx]):
        return build_tree(trajs, idx, tree).num_pairs()
    return sum(masked_tokens(trajs[i]) for i in idx)


def plan_update(trajectories: Sequence[dict[str, Any]], objective: ObjectiveConfig,
                minibatches: int, shares: Sequence[float], *, version: int = 0,
                staleness_bound: int | None = None) -> UpdatePlan:
    """Split the usable part of `trajectories` into `minibatches` (at most one per member)
    and each minibatch across len(shares) ranks in proportion to `shares` by tokens, a member
    never split; tokens past the staleness bound of an update from `version` leave the loss
    first (`mask_stale`; every rank checks it again). Raises ValueError when no group has two
    members."""
    trajs, dropped = usable(trajectories)
    trajs, stale = mask_stale(trajs, version, staleness_bound)
    if not trajs:
        raise ValueError("no group in the batch has two or more trajectories")
    if minibatches < 1 or not shares or min(shares) <= 0:
        raise ValueError(f"need minibatches >= 1 and positive shares, got {minibatches}, {list(shares)}")
    units = members(trajs)
    member = torch.zeros(len(trajs), dtype=torch.long)
    for u, idx in enumerate(units):
        member[idx] = u
    index: dict[Any, int] = {}
    groups = torch.tensor([index.setdefault(t["group_id"], len(index)) for t in trajs])
    rewards = torch.tensor([float(t["reward"]) for t in trajs], dtype=torch.float32)
    adv = member_advantages(rewards, objective.advantage, groups, member, objective.advantage_norm).tolist()
    tokens = [member_tokens(trajs, idx, objective.tree) for idx in units]
    seqs = [member_sequences(trajs, idx, objective.tree) for idx in units]
    mb = _cut(tokens, [1.0] * min(minibatches, len(units)))
    k = max(mb) + 1
    n0 = [sum(n for n, j in zip(tokens, mb) if j == i) for i in range(k)]
    s0 = [sum(n for n, j in zip(seqs, mb) if j == i) for i in range(k)]
    owner = [0] * len(units)
    for j in range(k):
        mine = [u for u in range(len(units)) if mb[u] == j]
        for u, r in zip(mine, _cut([tokens[u] for u in mine], list(shares))):
            owner[u] = r
    out = [Share([], [], [], n0, staleness_bound, s0) for _ in shares]
    for u, idx in enumerate(units):
        s = out[owner[u]]
        for i in idx:
            s.trajectories.append(trajs[i])
            s.advantages.append(float(adv[i]))
            s.minibatch.append(mb[u])
    return UpdatePlan(out, len(trajs), dropped, tokens, rewards.tolist(), [float(a) for a in adv], stale)


def _cut(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Contiguous assignment of items to len(weights) bins so that each bin's share of the
    total size follows `weights`: item i goes to the bin holding the midpoint of its span."""
    total = float(sum(sizes)) or 1.0
    bounds, acc = [], 0.0
    wsum = float(sum(weights))
    for w in weights:
        acc += w / wsum
        bounds.append(acc * total)
    out, pos = [], 0.0
    for n in sizes:
        mid = pos + n / 2.0
        out.append(next((b for b, hi in enumerate(bounds) if mid < hi), len(weights) - 1))
        pos += n
    return out


def split_share(share: Share, parts: int, tree: TreeConfig) -> list[Share]:
    """A cell's share split across its `parts` training ranks: each minibatch's members cut
    contiguously by tokens (a member never split), N0 and S0 unchanged (they are global), so
    the sum of the ranks' gradients is the cell's. Pure."""
    if parts <= 1:
        return [share]
    trajs = share.trajectories
    units = members(trajs)
    tokens = [member_tokens(trajs, idx, tree) for idx in units]
    owner = [0] * len(units)
    for j in sorted({share.minibatch[idx[0]] for idx in units}):
        mine = [u for u, idx in enumerate(units) if share.minibatch[idx[0]] == j]
        for u, r in zip(mine, _cut([tokens[u] for u in mine], [1.0] * parts)):
            owner[u] = r
    out = [Share([], [], [], list(share.n0), share.staleness_bound, list(share.s0)) for _ in range(parts)]
    for u, idx in enumerate(units):
        s = out[owner[u]]
        for i in idx:
            s.trajectories.append(trajs[i])
            s.advantages.append(share.advantages[i])
            s.minibatch.append(share.minibatch[i])
    return out

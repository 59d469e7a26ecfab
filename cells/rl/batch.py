"""A batch of finished trajectories as padded token tensors (the store's `to_api` format in).

Each segment of a session with sampled tokens is its own sequence; token t of a row is at
column t. A forked episode (a member with branch sessions `sid.b<k>`) is one serialised tree
instead (cells/rl/trees.py). Built on whichever process runs the compute (a training
cell, or the coordinator when no cell trains) from the JSON trajectories of its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from cells.rl.objectives.config import TreeConfig
from cells.rl.trees import TreeUnit, build_tree, is_tree, members, token_fields

EXACT, MISSING = "exact", "missing"
"""Provenance values of the store's trajectories (None: not scored yet)."""


@dataclass
class Batch:
    """Sequences (one per trajectory segment with sampled tokens) as padded (B, T) tensors;
    token t of a row is at column t."""

    ids: list[Tensor]
    mask: Tensor
    """Bool: sampled by the policy (never column 0: nothing predicts it)."""
    behav: Tensor
    old: Tensor
    """lp_old where exact, else 0."""
    missing: Tensor
    """Bool, within `mask`: lp_old missing or not yet scored (the EWMA stand-in is used)."""
    unscored: Tensor
    versions: Tensor
    """Behaviour version per sampled token (−1 elsewhere)."""
    traj: Tensor
    """The trajectory of each row."""
    rewards: Tensor
    """Per trajectory."""
    groups: Tensor
    """Group index per trajectory."""
    trees: list[TreeUnit] = field(default_factory=list)
    """The forked members, one serialised tree each (their trajectories have no rows)."""
    num_unrolled: int = 0
    """Forked members that could not form a tree (a branch with several segments): trained
    as separate rows, their shared prefix in branch 0's rows only."""
    starts: list[int] = field(default_factory=list)
    """Where each row begins in its trajectory's token buffer (its segment's start)."""

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @classmethod
    def build(cls, trajs: Sequence[dict[str, Any]], tree: TreeConfig | None = None) -> Batch:
        for t in trajs:
            if t.get("reward") is None:
                raise ValueError(f"trajectory {t.get('id')} has no reward (not finished?)")
        trees, plain, unrolled = [], [], 0
        for idx in members(trajs):
            if is_tree([trajs[i] for i in idx]):
                trees.append(build_tree(trajs, idx, tree or TreeConfig()))
            else:
                plain += idx
                unrolled += len(idx) > 1
        rows = [r for i in sorted(plain) for r in segments(i, trajs[i])]
        if not rows and not any(bool(u.ser.loss_mask.any()) for u in trees):
            raise ValueError("the batch has no sampled tokens")
        T = max((len(r["ids"]) for r in rows), default=1)
        index: dict[Any, int] = {}

        def stack(key: str, value: Any, dtype: torch.dtype) -> Tensor:
            return pad([r[key] for r in rows], T, value) if rows else torch.full((0, T), value, dtype=dtype)

        return cls(
            ids=[r["ids"] for r in rows],
            mask=stack("mask", False, torch.bool),
            behav=stack("behav", 0.0, torch.float32),
            old=stack("old", 0.0, torch.float32),
            missing=stack("missing", False, torch.bool),
            unscored=stack("unscored", False, torch.bool),
            versions=stack("versions", -1, torch.long),
            traj=torch.tensor([r["traj"] for r in rows], dtype=torch.long),
            rewards=torch.tensor([float(t["reward"]) for t in trajs], dtype=torch.float32),
            groups=torch.tensor([index.setdefault(t["group_id"], len(index)) for t in trajs]),
            trees=trees, num_unrolled=unrolled, starts=[r["start"] for r in rows],
        )

    def metrics(self, lp_theta: Tensor, version: int) -> dict[str, float]:
        """Provenance counts, staleness (in versions, against `version`) and how many exact
        old log-probs lp_theta reproduces bitwise."""
        exact = self.mask & ~self.missing
        stale = (version - self.versions)[self.mask].to(torch.float64)
        return {
            "num_sequences": float(self.size),
            "tokens_exact": float(exact.sum()),
            "tokens_missing": float((self.missing & ~self.unscored).sum()),
            "tokens_unscored": float(self.unscored.sum()),
            "staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
            "staleness_max": float(stale.max()) if stale.numel() else 0.0,
            "frac_bitwise_equal": float((lp_theta == self.old)[exact].double().mean())
            if bool(exact.any()) else float("nan"),
        }


def usable(trajectories: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Trajectories whose group has at least two members (a tree counts once), and how many
    were dropped."""
    counts: dict[Any, int] = {}
    for idx in members(trajectories):
        gid = trajectories[idx[0]].get("group_id")
        counts[gid] = counts.get(gid, 0) + 1
    keep = [t for t in trajectories
            if t.get("group_id") is not None and counts[t["group_id"]] >= 2]
    return keep, len(trajectories) - len(keep)


def segments(traj_index: int, t: dict[str, Any]) -> list[dict[str, Any]]:
    """Each segment of a trajectory that has sampled tokens, as per-token tensors."""
    n = len(t["token_ids"])
    for key in ("loss_mask", "logprobs", "versions", "old_logprobs", "provenance"):
        if len(t[key]) != n:
            raise ValueError(f"trajectory {t.get('id')}: {key} has {len(t[key])} entries "
                             f"for {n} tokens")
    starts = list(t.get("segment_starts") or [0]) + [n]
    out = []
    for a, b in zip(starts, starts[1:]):
        mask = [bool(x) for x in t["loss_mask"][a:b]]
        if b - a < 2 or not any(mask[1:]):
            continue
        mask[0] = False
        behav, old, miss, unsc, vers = zip(*(token_fields(t, i, mask[i - a]) for i in range(a, b)))
        out.append({
            "traj": traj_index, "start": a, "ids": torch.tensor(t["token_ids"][a:b], dtype=torch.long),
            "mask": torch.tensor(mask), "behav": torch.tensor(behav, dtype=torch.float32),
            "old": torch.tensor(old, dtype=torch.float32), "missing": torch.tensor(miss, dtype=torch.bool),
            "unscored": torch.tensor(unsc, dtype=torch.bool), "versions": torch.tensor(vers, dtype=torch.long),
        })
    return out


def pad(rows: Sequence[Tensor], length: int, value: Any) -> Tensor:
    """Stack 1-D tensors right-padded with `value` to `length`."""
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out

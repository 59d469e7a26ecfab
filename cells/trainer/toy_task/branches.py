"""Forked episodes as rollout trees.

A trainer recognises a tree as the sessions of one group whose ids share the stem before
`.b`, and whose token ids share a prefix (branch 0 sampled it; the others got the same tokens
from the gateway's full render of the shared messages): `rollout_tree` builds the
`RolloutTree` of objectives/tree.py from them, as the RL update does
(cells/rl/trees.py: one member of its group, trained with the tree loss).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cells.rl.objectives.tree import RolloutTree
from cells.rl.trees import trajectory_tree


def branch_session_id(session_id: str, branch: int) -> str:
    """Branch 0 continues in the trunk's session; branch b > 0 is `{session_id}.b{b}`."""
    return session_id if branch == 0 else f"{session_id}.b{branch}"


@dataclass
class BranchGroup:
    """Sessions of one forked episode: the stem id and the branch trajectories by index."""

    stem: str
    branches: dict[int, dict[str, Any]] = field(default_factory=dict)


def branch_groups(trajectories: Iterable[dict[str, Any]]) -> list[BranchGroup]:
    """Group trajectories by (group_id, stem): `sid` is branch 0, `sid.b{k}` branch k."""
    groups: dict[tuple[Any, str], BranchGroup] = {}
    for t in trajectories:
        m = re.fullmatch(r"(.*)\.b([1-9][0-9]*)", t["id"])
        stem, b = (m.group(1), int(m.group(2))) if m else (t["id"], 0)
        g = groups.setdefault((t.get("group_id"), stem), BranchGroup(stem))
        g.branches[b] = t
    return list(groups.values())


def rollout_tree(branches: Sequence[dict[str, Any]]) -> tuple[RolloutTree, list[int]]:
    """The rollout tree of forked sessions (single-segment trajectories, branch 0 first): the
    shared prefix is the root (loss mask: 1 where a branch sampled the token), each branch's
    remainder a leaf (cells/rl/trees.py, `trajectory_tree`). Returns (tree, leaf of each
    branch in input order)."""
    if not branches:
        raise ValueError("no branches")
    for b in branches:
        if len(b.get("segment_starts", [0])) != 1:
            raise ValueError(f"trajectory {b.get('id')} has several segments")
    tree, leaves, _ = trajectory_tree(branches)
    return tree, leaves

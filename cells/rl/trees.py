"""Tree rollouts in the RL update: a forked episode is one serialised tree, not one row per branch.

One line: a member's branch sessions (`sid`, `sid.b1`, ...) → their tree (the root is the
prefix they share, each branch's remainder a leaf) → the kept branches serialised once → one
forward over the serialised tokens (a node attends to its ancestors' keys only, position =
depth) → `tree_ppo_loss` with one advantage per branch (cells/rl/tree_loss.py).

Per token, the tree keeps the data of the session that sampled it: the shared prefix was
sampled once, by branch 0 (the others got the same tokens from the gateway's render of the
shared messages, loss mask 0), so its behaviour and old log-probs, provenance and version come
from branch 0; a leaf's from its own branch. The root stops before the first token that two
branches sampled: identical tokens sampled independently after the fork are separate samples,
each with its own behaviour log-prob, not one node. A member whose sessions cannot form a tree
(a branch with several segments) is trained as separate rows, counted (`num_trees_unrolled`).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cells.engine.embedded.model import Prepared, Segment, forward, target_logprobs
from cells.rl.objectives.config import TreeConfig
from cells.rl.objectives.tree import (
    RolloutTree,
    SerializedTree,
    select_branches_for,
    serialize_tree,
)

TokenFields = tuple[float, float, bool, bool, int]
"""(lp_behav, lp_old, missing, unscored, version) of one token (zeros / −1 outside the mask)."""


_BRANCH = re.compile(r"\.b\d+$")


def member_id(trajectory: dict[str, Any]) -> str:
    """The rollout a trajectory belongs to: its session id without a `.b<k>` branch suffix."""
    return _BRANCH.sub("", str(trajectory["id"]))


def token_fields(t: dict[str, Any], i: int, sampled: bool) -> TokenFields:
    """The per-token training data of token i of trajectory `t` (the store's `to_api` form)."""
    if not sampled:
        return 0.0, 0.0, False, False, -1
    lp, old, prov = t["logprobs"][i], t["old_logprobs"][i], t["provenance"][i]
    if lp is None:
        raise ValueError(f"trajectory {t.get('id')}: sampled token {i} has no log-prob")
    exact = prov == "exact" and old is not None
    version = int(t["versions"][i]) if t["versions"][i] is not None else -1
    return float(lp), float(old) if exact else 0.0, not exact, prov is None, version


def members(trajectories: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Indices of the trajectories of each member (a rollout: a session and its `.b<k>`
    branches, within one group), in order of first appearance."""
    out: dict[tuple[Any, str], list[int]] = {}
    for i, t in enumerate(trajectories):
        out.setdefault((t.get("group_id"), member_id(t)), []).append(i)
    return list(out.values())


def is_tree(branches: Sequence[dict[str, Any]]) -> bool:
    """Whether a member's sessions form a tree: several branches, each one segment."""
    return len(branches) > 1 and all(len(b.get("segment_starts") or [0]) == 1 for b in branches)


def _root_length(branches: Sequence[dict[str, Any]]) -> int:
    """Tokens of the shared root: the common prefix, cut before the first token two branches
    sampled, leaving every branch at least one token of its own."""
    seqs = [b["token_ids"] for b in branches]
    n = min(len(s) for s in seqs)
    common = 0
    while common < n and all(s[common] == seqs[0][common] for s in seqs) \
            and sum(bool(b["loss_mask"][common]) for b in branches) < 2:
        common += 1
    return min(common, n - 1)


def trajectory_tree(branches: Sequence[dict[str, Any]]
                    ) -> tuple[RolloutTree, list[int], list[list[tuple[int, int]]]]:
    """The rollout tree of a member's single-segment sessions (branch 0 first). Returns (tree,
    the leaf of each branch in input order, per node the (branch, position) each token's data
    comes from). The root's loss mask is 1 where a branch sampled the token; a root's first
    token is never in the loss (nothing predicts it)."""
    if not branches:
        raise ValueError("no branches")
    common = _root_length(branches) if len(branches) > 1 else len(branches[0]["token_ids"])
    tree, sources = RolloutTree(), []
    root = None
    if common:
        src = [next((b for b, t in enumerate(branches) if t["loss_mask"][i]), 0) for i in range(common)]
        mask = [bool(branches[b]["loss_mask"][i]) and i > 0 for i, b in enumerate(src)]
        root = tree.add_node(branches[0]["token_ids"][:common], None, mask)
        sources.append(list(zip(src, range(common))))
    leaves = []
    for b, t in enumerate(branches):
        if root is None and len(branches) == 1:
            break
        mask = [bool(x) for x in t["loss_mask"][common:]]
        if root is None and mask:
            mask[0] = False
        leaves.append(tree.add_node(t["token_ids"][common:], root, mask))
        sources.append([(b, i) for i in range(common, len(t["token_ids"]))])
    return tree, leaves or ([root] if root is not None else []), sources


@dataclass
class TreeUnit:
    """One member's tree as the update trains it: the serialised kept branches and the data of
    each serialised token."""

    ser: SerializedTree
    behav: Tensor
    old: Tensor
    """lp_old where exact, else 0."""
    missing: Tensor
    """Bool, within the mask: lp_old missing or not yet scored (the EWMA stand-in is used)."""
    unscored: Tensor
    versions: Tensor
    branch_trajs: list[int]
    """Index (in the caller's trajectory list) of the trajectory of each row of `ser.branches`."""

    @property
    def num_branches(self) -> int:
        return len(self.branch_trajs)

    @property
    def mask(self) -> Tensor:
        """(branches, L): branch membership and the loss mask (the (branch, token) pairs)."""
        return self.ser.branches & self.ser.loss_mask.unsqueeze(0)

    def num_pairs(self) -> int:
        """Masked (branch, token) pairs: the tree's share of N0."""
        return int(self.mask.sum())

    def num_sequences(self) -> int:
        """Branches with a token in the loss: the tree's share of S (sequence aggregations)."""
        return int((self.mask.sum(1) > 0).sum())


def build_tree(trajectories: Sequence[dict[str, Any]], indices: Sequence[int], cfg: TreeConfig) -> TreeUnit:
    """The TreeUnit of the member whose trajectories are `indices` (branch 0 = the trunk
    session, then its branches in creation order); branches kept by `cfg`, never by reward."""
    order = sorted(indices, key=lambda i: _branch_number(trajectories[i]))
    branches = [trajectories[i] for i in order]
    tree, leaves, sources = trajectory_tree(branches)
    stem = member_id(branches[0])
    kept = select_branches_for(tree, cfg, seed_offset=zlib.crc32(stem.encode()))
    ser = serialize_tree(tree, kept)
    cursor: dict[int, int] = {}
    rows: list[TokenFields] = []
    for node in ser.node_index.tolist():
        k = cursor.get(node, 0)
        cursor[node] = k + 1
        b, pos = sources[node][k]
        t = branches[b]
        rows.append(token_fields(t, pos, bool(tree.nodes[node].loss_mask[k])))
    behav, old, missing, unscored, versions = zip(*rows)
    return TreeUnit(ser, torch.tensor(behav, dtype=torch.float32), torch.tensor(old, dtype=torch.float32),
                    torch.tensor(missing), torch.tensor(unscored), torch.tensor(versions, dtype=torch.long),
                    [order[leaves.index(leaf)] for leaf in ser.leaves])


def _branch_number(t: dict[str, Any]) -> int:
    sid = str(t["id"])
    stem = member_id(t)
    return 0 if sid == stem else int(sid[len(stem) + 2:])


# -- the forward ----------------------------------------------------------------------------------
class _PathKV:
    """KV sink of one tree node: its keys/values follow those of its ancestors, so its tokens
    attend to their own root-to-node path and nothing else (the serialised tree's attention)."""

    def __init__(self, held: dict[tuple[int, int], tuple[Tensor, Tensor]], node: int, ancestors: list[int]) -> None:
        self.held, self.node, self.ancestors = held, node, ancestors

    def store_and_load(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.held[(self.node, layer)] = (k, v)
        if not self.ancestors:
            return k, v
        ks = [self.held[(a, layer)][0] for a in self.ancestors]
        vs = [self.held[(a, layer)][1] for a in self.ancestors]
        return torch.cat([*ks, k]), torch.cat([*vs, v])


def _segments(ser: SerializedTree) -> list[Segment]:
    """One segment per serialised node (depth-first: ancestors come first), its sink holding
    the ancestors' keys and values."""
    nodes, prev = ser.node_index.tolist(), ser.prev_index.tolist()
    first: dict[int, int] = {}
    for i, n in enumerate(nodes):
        first.setdefault(n, i)
    sizes = Counter(nodes)
    held: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    out = []
    for n, off in first.items():
        ancestors, t = [], prev[off]
        while t >= 0:
            a = nodes[t]
            ancestors.append(a)
            t = prev[first[a]]
        out.append(Segment(off, sizes[n], int(ser.positions[off]), _PathKV(held, n, ancestors[::-1])))
    return out


def tree_token_logprobs(prep: Prepared, ser: SerializedTree, token_ids: Tensor, temperature: float,
                        tile: int | None) -> Tensor:
    """Log-prob of every serialised token given its path (0 for a root's first token), from one
    forward over the tree: equal to each branch's own causal forward (the same rows enter the
    same kernels at the same positions). `token_ids` are the serialised ids as `prep` indexes
    them (e.g. compacted)."""
    hidden = forward(prep, token_ids, ser.positions, _segments(ser), tile)
    src = ser.prev_index.clamp(min=0)
    out = target_logprobs(prep, hidden.index_select(0, src), token_ids, temperature, tile)
    return torch.where(ser.prev_index >= 0, out, torch.zeros_like(out))

"""Tree rollouts: sub-agents, parallel tool calls and compaction make a rollout a tree.

    build (RolloutTree.add_node) → select ≤ 5 branches, blind to rewards → serialise once →
    score the serialised tokens → tree_ppo_loss with one advantage per branch

Serialisation is depth-first; a token attends only to itself, earlier tokens of its node and
its ancestors' tokens; its position is its depth. The logits that predict token t sit at
`prev_index[t]` (the previous token on t's own path, not t − 1 in the serialisation).

    L = −(1/N0) · sum_t sum_{b ∈ S(t)} M'_t · w_t · min(r_t·A_b, clip(r_t)·A_b),  N0 = sum_b |b|

This equals the decoupled PPO loss on the unrolled branches (token mean over all their
tokens), which is how it is computed: every token tensor is broadcast to (branches, tokens)
and masked by the branch membership S. Sequence-level corrections thus act per branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cells.rl.objectives.config import ObjectiveConfig, TreeConfig
from cells.rl.objectives.ppo import decoupled_ppo_loss

MAX_BRANCHES = 5
"""At most this many root-to-leaf branches are kept per tree."""


@dataclass(slots=True)
class TreeNode:
    """A span of tokens continuing its parent's context."""

    token_ids: list[int]
    parent: int | None
    loss_mask: list[bool]
    """True for tokens sampled by the policy (tool output and prompts are False)."""
    children: list[int] = field(default_factory=list)


class RolloutTree:
    """Nodes in creation order; node ids are indices. `add_node` is the only mutation."""

    def __init__(self) -> None:
        self.nodes: list[TreeNode] = []

    def add_node(
        self,
        token_ids: Sequence[int],
        parent: int | None = None,
        loss_mask: bool | Sequence[bool] = False,
    ) -> int:
        """Append a node under `parent` (None: a new root); returns its id."""
        if parent is not None and not 0 <= parent < len(self.nodes):
            raise ValueError(
                f"parent {parent} is not a node of this tree ({len(self.nodes)} nodes)"
            )
        ids = [int(t) for t in token_ids]
        if isinstance(loss_mask, bool):
            mask = [loss_mask] * len(ids)
        else:
            mask = [bool(x) for x in loss_mask]
            if len(mask) != len(ids):
                raise ValueError(f"loss_mask has {len(mask)} entries for {len(ids)} tokens")
        node_id = len(self.nodes)
        self.nodes.append(TreeNode(ids, parent, mask))
        if parent is not None:
            self.nodes[parent].children.append(node_id)
        return node_id

    def leaves(self) -> list[int]:
        """Nodes without children, in creation order."""
        return [i for i, n in enumerate(self.nodes) if not n.children]

    def path(self, node: int) -> list[int]:
        """Node ids from the root down to `node`."""
        out = []
        cur: int | None = node
        while cur is not None:
            out.append(cur)
            cur = self.nodes[cur].parent
        return out[::-1]

    def branch_token_ids(self, leaf: int) -> list[int]:
        """The tokens of the root-to-`leaf` branch, unrolled."""
        return [t for n in self.path(leaf) for t in self.nodes[n].token_ids]

    def branch_loss_mask(self, leaf: int) -> list[bool]:
        """The loss mask of the root-to-`leaf` branch, unrolled."""
        return [m for n in self.path(leaf) for m in self.nodes[n].loss_mask]


def select_branches(
    tree: RolloutTree,
    max_branches: int = MAX_BRANCHES,
    *,
    strategy: str = "creation_order",
    seed: int = 0,
) -> list[int]:
    """Leaves of the kept branches, in creation order; never looks at rewards.

    `creation_order` keeps the first leaves created; `seeded` draws them with a seeded
    generator (the same seed and tree give the same choice on any machine).
    """
    if not 1 <= max_branches <= MAX_BRANCHES:
        raise ValueError(f"max_branches must lie in [1, {MAX_BRANCHES}], got {max_branches}")
    leaves = tree.leaves()
    if not leaves:
        raise ValueError("the tree has no nodes")
    if strategy == "creation_order":
        return leaves[:max_branches]
    if strategy == "seeded":
        gen = torch.Generator().manual_seed(seed)
        picked = torch.randperm(len(leaves), generator=gen)[:max_branches]
        return sorted(leaves[i] for i in picked.tolist())
    raise ValueError(
        f"unknown selection strategy {strategy!r}; expected 'creation_order' or 'seeded'"
    )


def select_branches_for(tree: RolloutTree, cfg: TreeConfig, seed_offset: int = 0) -> list[int]:
    """`select_branches` with the configured strategy; `seed_offset` separates trees."""
    return select_branches(
        tree, cfg.max_branches, strategy=cfg.selection, seed=cfg.seed + seed_offset
    )


@dataclass(frozen=True)
class SerializedTree:
    """The kept part of a tree as one sequence of L tokens with nb branches."""

    token_ids: Tensor
    """(L,) int64, depth-first."""
    positions: Tensor
    """(L,) int64: the token's depth (its index on its own root-to-leaf path)."""
    attention_mask: Tensor
    """(L, L) bool: [i, j] True iff token j is token i or one of its ancestors."""
    branches: Tensor
    """(nb, L) bool: the membership matrix S, [b, t] True iff token t lies on branch b."""
    loss_mask: Tensor
    """(L,) bool: M, tokens sampled by the policy."""
    prev_index: Tensor
    """(L,) int64: index of the token before t on its path (−1 for a root's first token);
    the logits predicting token t are those at prev_index[t]."""
    node_index: Tensor
    """(L,) int64: the tree node each token belongs to."""
    leaves: tuple[int, ...]
    """Leaf node of each branch, in the order of the rows of `branches`."""

    def branch_indices(self, b: int) -> Tensor:
        """Serialised indices of branch b's tokens, in path order."""
        return self.branches[b].nonzero().squeeze(-1)


def serialize_tree(tree: RolloutTree, leaves: Sequence[int]) -> SerializedTree:
    """Serialise the union of the root-to-leaf paths of `leaves`, depth-first."""
    if not leaves:
        raise ValueError("no branches to serialise")
    for leaf in leaves:
        if not 0 <= leaf < len(tree.nodes) or tree.nodes[leaf].children:
            raise ValueError(f"{leaf} is not a leaf of the tree")
    paths = [tree.path(leaf) for leaf in leaves]
    order = _depth_first(tree, {n for p in paths for n in p})
    tokens, positions, loss_mask, prev, node_of = _lay_out(tree, order)
    attention, branches = _tree_masks(tree, order, paths, node_of)
    prev_t = torch.tensor(prev, dtype=torch.long)
    mask_t = torch.tensor(loss_mask, dtype=torch.bool)
    if bool((mask_t & (prev_t < 0)).any()):
        raise ValueError("a root's first token cannot be in the loss mask: nothing predicts it")
    return SerializedTree(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        attention_mask=attention,
        branches=branches,
        loss_mask=mask_t,
        prev_index=prev_t,
        node_index=torch.tensor(node_of, dtype=torch.long),
        leaves=tuple(leaves),
    )


def _depth_first(tree: RolloutTree, kept: set[int]) -> list[int]:
    """The `kept` nodes depth-first, roots and children in creation order."""
    order: list[int] = []
    stack = [n for n in sorted(kept, reverse=True) if tree.nodes[n].parent is None]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(c for c in reversed(tree.nodes[node].children) if c in kept)
    return order


def _lay_out(tree: RolloutTree, order: list[int]
             ) -> tuple[list[int], list[int], list[bool], list[int], list[int]]:
    """The nodes' tokens in `order`: (token ids, positions, loss mask, index of each token's
    predecessor on its path (-1 for a root's first), node of each token)."""
    depth: dict[int, int] = {}  # depth of each node's first token
    last: dict[int, int] = {}  # serialised index of the last token on the path up to the node
    tokens, positions, loss_mask, prev, node_of = [], [], [], [], []
    for node in order:
        nd = tree.nodes[node]
        parent = nd.parent
        depth[node] = 0 if parent is None else depth[parent] + len(tree.nodes[parent].token_ids)
        before = -1 if parent is None else last[parent]
        for k, (tok, m) in enumerate(zip(nd.token_ids, nd.loss_mask, strict=True)):
            prev.append(before if k == 0 else len(tokens) - 1)
            tokens.append(tok)
            positions.append(depth[node] + k)
            loss_mask.append(m)
            node_of.append(node)
        last[node] = len(tokens) - 1 if nd.token_ids else before
    return tokens, positions, loss_mask, prev, node_of


def _tree_masks(tree: RolloutTree, order: list[int], paths: list[list[int]], node_of: list[int]
                ) -> tuple[Tensor, Tensor]:
    """(attention: token i sees token j iff j's node is on i's path and j <= i,
    branches: token t lies on branch b's path)."""
    num_tokens = len(node_of)
    dense = {n: i for i, n in enumerate(order)}
    node_idx = torch.tensor([dense[n] for n in node_of], dtype=torch.long)
    ancestors = torch.zeros(len(order), len(order), dtype=torch.bool)  # [a, b]: b on a's path
    for n in order:
        for a in tree.path(n):
            ancestors[dense[n], dense[a]] = True
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    attention = ancestors[node_idx][:, node_idx] & causal
    on_branch = torch.zeros(len(paths), len(order), dtype=torch.bool)
    for b, p in enumerate(paths):
        on_branch[b, [dense[n] for n in p]] = True
    return attention, on_branch[:, node_idx]


def tree_ppo_loss(
    tree: SerializedTree,
    lp_theta: Tensor,
    lp_prox: Tensor,
    lp_behav: Tensor,
    branch_advantages: Tensor,
    cfg: ObjectiveConfig,
    *,
    lp_old: Tensor | None = None,
    provenance: Tensor | None = None,
    lp_stand: Tensor | None = None,
    lp_ref: Tensor | None = None,
    num_pairs: Tensor | float | None = None,
    normalizer: Tensor | float | None = None,
    token_scale: Tensor | None = None,
    versions_behind: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The tree loss over serialised tokens (L,) with one advantage per branch (nb,); its
    sequences (the sequence ratio, the sequence-level aggregations) are the branches.

    `num_pairs` is N0, the number of masked (branch, token) pairs; pass the sum over
    data-parallel ranks. Metrics count (branch, token) pairs.
    """
    nb, length = tree.branches.shape
    if branch_advantages.shape != (nb,):
        raise ValueError(f"branch_advantages must have shape ({nb},), got {tuple(branch_advantages.shape)}")
    named = {"lp_theta": lp_theta, "lp_prox": lp_prox, "lp_behav": lp_behav, "lp_old": lp_old,
             "provenance": provenance, "lp_stand": lp_stand, "lp_ref": lp_ref, "versions_behind": versions_behind}
    for name, t in named.items():
        if t is not None and t.shape != (length,):
            raise ValueError(f"{name} must have shape ({length},), got {tuple(t.shape)}")

    def per_branch(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.unsqueeze(0).expand(nb, length)

    device = lp_theta.device
    mask = tree.branches.to(device) & tree.loss_mask.to(device).unsqueeze(0)
    return decoupled_ppo_loss(
        per_branch(lp_theta),
        per_branch(lp_prox),
        per_branch(lp_behav),
        branch_advantages,
        mask,
        cfg,
        lp_old=per_branch(lp_old),
        provenance=per_branch(provenance),
        lp_stand=per_branch(lp_stand),
        lp_ref=per_branch(lp_ref),
        num_tokens=num_pairs,
        normalizer=normalizer,
        token_scale=token_scale,
        seq_index=torch.arange(nb, device=device),
        versions_behind=per_branch(versions_behind),
    )

"""Tree rollouts: branch selection, depth-first serialisation, and the tree loss and gradients
against the explicit per-branch computation on unrolled branches."""

import math

import pytest
import torch

from cells.rl.objectives.config import (
    MISSequenceCorrection,
    NoCorrection,
    ObjectiveConfig,
    TISTokenCorrection,
    TreeConfig,
)
from cells.rl.objectives.ppo import decoupled_ppo_loss
from cells.rl.objectives.tree import (
    RolloutTree,
    select_branches,
    select_branches_for,
    serialize_tree,
    tree_ppo_loss,
)

torch.set_num_threads(1)

F64 = torch.float64


def _small_tree():
    #        root [1 2 3] (prompt)
    #        /             \
    #     a [4 5]          b [6]
    #     /     \
    #  c [7 8]  d [9]
    tree = RolloutTree()
    root = tree.add_node([1, 2, 3])
    a = tree.add_node([4, 5], root, loss_mask=True)
    b = tree.add_node([6], root, loss_mask=True)
    c = tree.add_node([7, 8], a, loss_mask=[True, False])
    d = tree.add_node([9], a, loss_mask=True)
    return tree, (root, a, b, c, d)


def test_serialisation_layout():
    tree, (root, a, b, c, d) = _small_tree()
    assert tree.leaves() == [b, c, d]
    s = serialize_tree(tree, [b, c, d])
    assert s.token_ids.tolist() == [1, 2, 3, 4, 5, 7, 8, 9, 6]  # depth-first
    assert s.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 3]  # position = depth
    assert s.prev_index.tolist() == [-1, 0, 1, 2, 3, 4, 5, 4, 2]  # the previous token on the path
    assert s.loss_mask.tolist() == [False] * 3 + [True, True, True, False, True, True]
    assert s.branches.int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0, 1],  # root + b
        [1, 1, 1, 1, 1, 1, 1, 0, 0],  # root + a + c
        [1, 1, 1, 1, 1, 0, 0, 1, 0],  # root + a + d
    ]
    att = s.attention_mask
    seen = lambda i: att[i].nonzero().squeeze(-1).tolist()
    assert seen(7) == [0, 1, 2, 3, 4, 7]  # d sees root, a, itself; not c
    assert seen(8) == [0, 1, 2, 8]  # b sees only the root
    assert seen(6) == [0, 1, 2, 3, 4, 5, 6]
    assert not att.triu(1).any()
    for leaf_row, leaf in enumerate([b, c, d]):
        idx = s.branch_indices(leaf_row)
        assert s.token_ids[idx].tolist() == tree.branch_token_ids(leaf)
        assert s.positions[idx].tolist() == list(range(len(idx)))


def test_serialising_a_subset_leaves_out_other_branches():
    tree, (root, a, b, c, d) = _small_tree()
    s = serialize_tree(tree, [d])
    assert s.token_ids.tolist() == [1, 2, 3, 4, 5, 9]
    with pytest.raises(ValueError, match="not a leaf"):
        serialize_tree(tree, [a])
    bad = RolloutTree()
    bad.add_node([1], loss_mask=True)
    with pytest.raises(ValueError, match="nothing predicts it"):
        serialize_tree(bad, [0])


def _wide_tree(num_leaves):
    tree = RolloutTree()
    root = tree.add_node([0, 1])
    return tree, [tree.add_node([10 + i], root, loss_mask=True) for i in range(num_leaves)]


def test_branch_selection_is_capped_and_blind_to_rewards():
    tree, leaves = _wide_tree(8)
    assert select_branches(tree, 5) == leaves[:5]
    draw = select_branches(tree, 5, strategy="seeded", seed=7)
    assert len(draw) == 5 and draw == sorted(draw) and set(draw) <= set(leaves)
    assert select_branches(tree, 5, strategy="seeded", seed=7) == draw
    draws = {tuple(select_branches(tree, 5, strategy="seeded", seed=s)) for s in range(10)}
    assert len(draws) > 1
    assert select_branches_for(tree, TreeConfig(max_branches=3)) == leaves[:3]
    small, few = _wide_tree(2)
    assert select_branches(small, 5) == few
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        select_branches(tree, 6)
    with pytest.raises(ValueError, match="strategy"):
        select_branches(tree, 2, strategy="best_reward")
    with pytest.raises(ValueError, match="parent"):
        tree.add_node([1], parent=99)
    with pytest.raises(ValueError, match="loss_mask"):
        tree.add_node([1, 2], parent=0, loss_mask=[True])


class TinyLM(torch.nn.Module):
    """One attention layer over learned positions: enough to tell masks and positions apart."""

    def __init__(self, vocab=16, dim=8, max_pos=16):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        p = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g, dtype=F64) * 0.5)
        self.emb, self.pos = p(vocab, dim), p(max_pos, dim)
        self.qkv, self.out, self.head = p(dim, 3 * dim), p(dim, dim), p(dim, vocab)

    def forward(self, tokens, positions, attn):
        h = self.emb[tokens] + self.pos[positions]
        q, k, v = (h @ self.qkv).chunk(3, dim=-1)
        scores = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~attn, -math.inf)
        h = h + torch.softmax(scores, dim=-1) @ v @ self.out
        return torch.log_softmax(h @ self.head, dim=-1)


def _tree_logprobs(model, s):
    logp = model(s.token_ids, s.positions, s.attention_mask)
    prev = s.prev_index.clamp(min=0)
    lp = logp[prev, s.token_ids]
    return torch.where(s.prev_index >= 0, lp, 0.0)


def _branch_logprobs(model, tokens):
    t = torch.tensor(tokens)
    n = len(tokens)
    logp = model(t, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    return torch.cat([torch.zeros(1, dtype=F64), logp[:-1].gather(1, t[1:, None]).squeeze(1)])


def test_tree_loss_and_gradients_equal_the_unrolled_branches():
    tree, (root, a, b, c, d) = _small_tree()
    leaves = [b, c, d]
    s = serialize_tree(tree, leaves)
    length = s.token_ids.shape[0]
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        lp_behav = -torch.rand(length, generator=g, dtype=F64) - 1
        lp_old = lp_behav + 0.3 * torch.randn(length, generator=g, dtype=F64)
        lp_prox = lp_old + 0.3 * torch.randn(length, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    eps, cap, cap_s = 0.2, 1.3, 1.5
    cfg = ObjectiveConfig(
        correction=TISTokenCorrection(cap=cap), staleness_cap=cap_s, clip_low=eps, clip_high=eps
    )

    model = TinyLM()
    lp_tree = _tree_logprobs(model, s)
    loss, metrics = tree_ppo_loss(s, lp_tree, lp_prox, lp_behav, adv, cfg, lp_old=lp_old)
    tree_grads = torch.autograd.grad(loss, list(model.parameters()))

    # explicit: each branch run on its own (causal, positions 0..n−1), token mean over all of them
    total, count = 0.0, 0
    for bi, leaf in enumerate(leaves):
        lp_branch = _branch_logprobs(model, tree.branch_token_ids(leaf))
        idx = s.branch_indices(bi)
        torch.testing.assert_close(lp_branch[1:], lp_tree[idx][1:])  # same numbers as the tree
        for j, (lp_t, m) in enumerate(zip(lp_branch, tree.branch_loss_mask(leaf), strict=True)):
            if not m:
                continue
            i = idx[j]
            w = min(math.exp(lp_old[i] - lp_behav[i]), cap) * min(
                math.exp(lp_prox[i] - lp_old[i]), cap_s
            )
            r = torch.exp(lp_t - lp_prox[i])
            total = total + w * torch.minimum(r * adv[bi], r.clamp(1 - eps, 1 + eps) * adv[bi])
            count += 1
    explicit = -total / count
    explicit_grads = torch.autograd.grad(explicit, list(model.parameters()))
    assert count == 7 and metrics["num_tokens"] == 7  # a's 2 tokens count once per branch (twice)
    torch.testing.assert_close(loss, explicit)
    for gt, ge in zip(tree_grads, explicit_grads, strict=True):
        torch.testing.assert_close(gt, ge)
    assert any(gt.abs().sum() > 0 for gt in tree_grads)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_gspo_on_a_tree_takes_each_branch_as_its_sequence(agg):
    """GSPO on a tree: branch b's ratio s_b = exp(mean over its loss tokens of lp − lp_prox),
    a shared token carrying each branch's own s_b; the loss of the explicit per-branch sum."""
    tree, (root, a, b, c, d) = _small_tree()
    leaves = [b, c, d]
    s = serialize_tree(tree, leaves)
    g = torch.Generator().manual_seed(5)
    model = TinyLM()
    lp_tree = _tree_logprobs(model, s)
    with torch.no_grad():
        lp_prox = lp_tree.detach() + 0.05 * torch.randn(lp_tree.shape, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    eps = 0.03
    cfg = ObjectiveConfig(ratio="sequence", clip_low=eps, clip_high=eps, loss_agg=agg, correction=NoCorrection())
    pairs = (s.branches & s.loss_mask.unsqueeze(0)).sum(1).to(F64)
    scale = None if agg == "token_mean" else (1.0 / (3 * pairs)).unsqueeze(1).expand(3, s.token_ids.shape[0])
    loss, metrics = tree_ppo_loss(s, lp_tree, lp_prox, lp_prox.clone(), adv, cfg, lp_old=lp_prox.clone(),
                                  token_scale=scale)
    tree_grads = torch.autograd.grad(loss, list(model.parameters()))
    total, clipped, ratios = 0.0, 0, []
    for bi, leaf in enumerate(leaves):
        idx = s.branch_indices(bi)
        lp_branch = _branch_logprobs(model, tree.branch_token_ids(leaf))
        keep = [j for j, m in enumerate(tree.branch_loss_mask(leaf)) if m]
        log_s = sum(lp_branch[j] - lp_prox[idx[j]] for j in keep) / len(keep)
        r = torch.exp(log_s)
        ratios.append(float(r))
        per_token = torch.minimum(r * adv[bi], r.clamp(1 - eps, 1 + eps) * adv[bi])
        clipped += len(keep) * int(abs(float(r) - 1) > eps)
        total = total + per_token * len(keep) * (1.0 / 7 if agg == "token_mean" else 1.0 / (3 * len(keep)))
    explicit = -total
    explicit_grads = torch.autograd.grad(explicit, list(model.parameters()))
    assert any(abs(x - 1) > eps for x in ratios) and any(abs(x - 1) <= eps for x in ratios), ratios
    torch.testing.assert_close(loss, explicit)
    for gt, ge in zip(tree_grads, explicit_grads, strict=True):
        torch.testing.assert_close(gt, ge)
    assert metrics["num_tokens"] == 7 and 0 < metrics["clip_frac"] < 1


def test_sequence_corrections_act_per_branch():
    tree, (root, a, b, c, d) = _small_tree()
    leaves = [b, c, d]
    s = serialize_tree(tree, leaves)
    length = s.token_ids.shape[0]
    g = torch.Generator().manual_seed(13)
    lp_behav = -torch.rand(length, generator=g, dtype=F64) - 1
    lp_old = lp_behav + 0.4 * torch.randn(length, generator=g, dtype=F64)
    lp_theta = (lp_old + 0.1 * torch.randn(length, generator=g, dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    cfg = ObjectiveConfig(correction=MISSequenceCorrection(low=0.6, high=1.6), self_normalize=True)
    loss, _ = tree_ppo_loss(s, lp_theta, lp_old, lp_behav, adv, cfg, lp_old=lp_old)
    # the same branches unrolled into a padded batch
    width = max(len(tree.branch_token_ids(leaf)) for leaf in leaves)
    rows = {k: torch.zeros(3, width, dtype=F64) for k in ("theta", "old", "behav")}
    mask = torch.zeros(3, width)
    theta_rows = []
    for bi, leaf in enumerate(leaves):
        idx = s.branch_indices(bi)
        n = len(idx)
        theta_rows.append(torch.cat([lp_theta[idx], torch.zeros(width - n, dtype=F64)]))
        rows["old"][bi, :n], rows["behav"][bi, :n] = lp_old[idx], lp_behav[idx]
        mask[bi, :n] = torch.tensor(tree.branch_loss_mask(leaf), dtype=torch.float32)
    unrolled, _ = decoupled_ppo_loss(
        torch.stack(theta_rows), rows["old"], rows["behav"], adv, mask, cfg, lp_old=rows["old"]
    )
    torch.testing.assert_close(loss, unrolled)


def test_tree_loss_bad_shapes():
    tree, (root, a, b, c, d) = _small_tree()
    s = serialize_tree(tree, [b, c, d])
    x = torch.zeros(9, dtype=F64)
    cfg = ObjectiveConfig()
    with pytest.raises(ValueError, match="branch_advantages"):
        tree_ppo_loss(s, x, x, x, torch.zeros(2), cfg, lp_old=x)
    with pytest.raises(ValueError, match="lp_prox"):
        tree_ppo_loss(s, x, torch.zeros(8), x, torch.zeros(3), cfg, lp_old=x)

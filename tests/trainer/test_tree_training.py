"""Tree rollouts reach the tree loss: a toy-task episode forked into 3 branches is one member of
its group, trained through the real update path (plan → batch → update) as one serialised tree;
its loss and gradients equal the explicit per-branch computation."""

from __future__ import annotations

import math

import pytest
import torch

from cells.engine.embedded.model import init_weights, prepare, token_logprobs
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.batch import Batch
from cells.rl.learner import Learner
from cells.rl.objectives import (
    KLInLoss,
    ObjectiveConfig,
    RLOOAdvantage,
    decoupled_ppo_loss,
    member_advantages,
)
from cells.rl.objectives.config import GRPOAdvantage
from cells.rl.plan import plan_update
from cells.trainer.toy_task import (
    LocalGateway,
    TaskSpec,
    answer_text,
    completion_ids,
    make_episode,
    oracle_messages,
    run_episode,
)

torch.set_num_threads(1)

SPEC = TaskSpec()


def _episode():
    for i in range(5000):
        ep = make_episode(SPEC, i)
        if len(ep.items) == 1 and ep.depth == 2:
            return ep
    raise AssertionError("no such episode")


def _forked_group(learner: Learner) -> list[dict]:
    """Group `g`: member `t` forks after its first tool results into 3 branches (rewards 1, 1,
    0.5), member `u` answers wrong at once (reward 0). Behaviour log-probs near the learner's
    own, old log-probs exact (the learner's), two tokens of branch 2 missing."""
    from scheduler.gateway.tito.memory import ReplayEngine

    ep = _episode()
    engine = ReplayEngine()
    with LocalGateway(engine) as gw:
        turns = [completion_ids(gw.renderer, m) for m in oracle_messages(ep)]
        wrong = completion_ids(gw.renderer, {"role": "assistant", "content": answer_text(
            [next(c for c in SPEC.codes if c != ep.expected[0])])})
        engine.script("t", turns)
        engine.script("t.b1", turns[1:])
        engine.script("t.b2", [turns[1], wrong])
        engine.script("u", [wrong])
        _, stats = run_episode(gw, ep, session_id="t", branches=3, group_id="g", finish=gw.finish)
        run_episode(gw, ep, session_id="u", group_id="g", finish=gw.finish)
        trajs = [gw.trajectory(s) for s in ("t", "t.b1", "t.b2", "u")]
    assert [b["reward"] for b in stats["branches"]] == [1.0, 1.0, 0.5] and trajs[3]["reward"] == 0.0
    for t in trajs:
        old = learner.logprobs(t["token_ids"]).tolist()
        for i, m in enumerate(t["loss_mask"]):
            if m:
                t["old_logprobs"][i] = old[i - 1]
                t["logprobs"][i] = old[i - 1] + 0.05 * math.sin(i)  # r_d != 1
                t["provenance"][i] = "exact"
    sampled = [i for i, m in enumerate(trajs[2]["loss_mask"]) if m]
    for i in sampled[-2:]:
        trajs[2]["provenance"][i], trajs[2]["old_logprobs"][i] = "missing", None
    return trajs


def _unrolled(trajs: list[dict]) -> list[dict]:
    """Each branch as its own sequence with the tree's data: the shared prefix (sampled by
    branch 0, the others got its tokens from the gateway's render) carries branch 0's
    sampled tokens in every branch; the rest is the branch's own."""
    trunk, out = trajs[0], []
    for t in trajs:
        ids, rows = t["token_ids"], []
        for i in range(len(ids)):
            shared = t is not trunk and not t["loss_mask"][i] and i < len(trunk["token_ids"]) \
                and trunk["token_ids"][: i + 1] == ids[: i + 1] and trunk["loss_mask"][i]
            src = trunk if shared else t
            m = bool(src["loss_mask"][i])
            rows.append((m, src["logprobs"][i] if m else 0.0, src["old_logprobs"][i] if m else None,
                         src["provenance"][i] == "missing" if m else False))
        out.append({"ids": ids, "rows": rows})
    return out


def _explicit_loss_and_grads(learner: Learner, trajs: list[dict], adv: list[float]):
    """decoupled PPO on the unrolled branches, token mean over all their (branch, token)
    pairs, lp_theta from each branch's own full-model forward; lp_stand from the EWMA copy."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in learner.params.items()}
    seqs = _unrolled(trajs)
    T = max(len(s["ids"]) for s in seqs)
    shape = (len(seqs), T)
    lt, lp, behav, old, stand = (torch.zeros(shape) for _ in range(5))
    mask, missing = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    prep = prepare(learner.spec, params)
    for b, s in enumerate(seqs):
        ids = torch.tensor(s["ids"])
        theta = token_logprobs(prep, ids, 1.0, learner.tile)
        n = len(s["ids"])
        lt[b, 1:n] = theta
        lp[b, 1:n] = theta.detach()
        stand[b, 1:n] = learner.logprobs(s["ids"], "ewma")
        for i, (m, lb, lo, miss) in enumerate(s["rows"]):
            if m and i > 0:
                mask[b, i], behav[b, i], missing[b, i] = True, lb, miss
                old[b, i] = 0.0 if miss else lo
    ref = None
    if learner.objective.kl is not None:
        ref = torch.zeros(shape)
        for b, s in enumerate(seqs):
            ref[b, 1:len(s["ids"])] = learner.logprobs(s["ids"], "reference")
    scale = None  # a sequence-level aggregation by hand: each branch 1/(S·its tokens)
    if learner.objective.loss_agg == "seq_mean_token_mean":
        n = mask.sum(1, keepdim=True).to(torch.float32)
        scale = torch.where(n > 0, 1.0 / (int((n > 0).sum()) * n.clamp(min=1)), 0.0).expand(shape)
    # each row its own sequence: the sequence ratio is the branch's
    loss, _ = decoupled_ppo_loss(lt, lp, behav, torch.tensor(adv), mask, learner.objective,
                                 lp_old=old, provenance=missing, lp_stand=stand, lp_ref=ref, token_scale=scale)
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in params.items()}, int(mask.sum())


@pytest.fixture(scope="module")
def learner_and_group():
    spec = PRESETS["toy"]
    learner = Learner(spec, init_weights(spec, 5, 0.1), lr=1e-3, minibatches=1, max_grad_norm=None)
    return learner, _forked_group(learner)


def test_an_episode_with_three_branches_is_one_tree_member(learner_and_group):
    learner, trajs = learner_and_group
    b = Batch.build(trajs)
    assert len(b.trees) == 1 and b.size == 1  # the fork: one tree; `u`: one row
    u = b.trees[0]
    assert u.num_branches == 3 and [trajs[i]["id"] for i in u.branch_trajs] == ["t", "t.b1", "t.b2"]
    assert len(u.ser.token_ids) < sum(len(t["token_ids"]) for t in trajs[:3])  # prefix once
    # the tree's forward is each branch's own forward, token for token
    lp = learner.tree_logprobs(learner.params, u.ser, False)[0]
    for row, i in enumerate(u.branch_trajs):
        path = u.ser.branch_indices(row)
        assert u.ser.token_ids[path].tolist() == trajs[i]["token_ids"]
        torch.testing.assert_close(lp[path][1:], learner.logprobs(trajs[i]["token_ids"]), rtol=0, atol=0)
    # the group's statistics are over its two members, each branch with its own advantage
    plan = plan_update(trajs, learner.objective, 1, [1.0])
    r_m = torch.tensor([2.5 / 3, 0.0], dtype=torch.float64)
    std = r_m.std()
    expect = [(r - r_m.mean()) / (std + 1e-6) for r in (1.0, 1.0, 0.5, 0.0)]
    assert plan.advantages == pytest.approx([float(x) for x in expect], rel=1e-5)
    assert len(plan.tokens) == 2 and plan.shares[0].n0 == [sum(plan.tokens)]


@pytest.mark.parametrize("kl", [False, True, "gspo"])
def test_tree_loss_and_gradients_equal_the_explicit_per_branch_computation(learner_and_group, kl):
    """`gspo`: a tree's sequences are its branches, for GSPO's ratio and the sequence mean."""
    learner, trajs = learner_and_group
    if kl == "gspo":
        learner = Learner(learner.spec, learner.weights(), lr=1e-3, minibatches=1, max_grad_norm=None,
                          objective=ObjectiveConfig(ratio="sequence", loss_agg="seq_mean_token_mean",
                                                    clip_low=0.01, clip_high=0.01))
    elif kl:  # the KL term in the loss, against a reference away from the current weights
        learner = Learner(learner.spec, learner.weights(), lr=1e-3, minibatches=1, max_grad_norm=None,
                          objective=ObjectiveConfig(kl=KLInLoss(coef=0.5)))
        learner.set_reference({k: v + 0.02 * torch.randn_like(v) for k, v in learner.weights().items()})
    plan = plan_update(trajs, learner.objective, 1, [1.0])
    loss_ref, grads_ref, pairs = _explicit_loss_and_grads(learner, trajs, plan.advantages)
    assert plan.shares[0].n0 == [pairs]  # N0 counts (branch, token) pairs
    got = {}
    step = learner.apply_gradients

    def capture() -> float:
        got.update({k: p.grad.clone() for k, p in learner.params.items()})
        return step()

    learner.apply_gradients = capture
    m = learner.rl_step(trajs)
    assert m["num_trees"] == 1 and m["num_tokens"] == pairs and m["tokens_missing"] == 2
    assert m["loss"] == pytest.approx(loss_ref, rel=1e-5, abs=1e-7)
    assert (m["kl_loss"] != 0.0) == (kl is True)
    for k, g in grads_ref.items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-7, msg=k)
    assert any(float(g.abs().sum()) > 0 for g in grads_ref.values())


def test_member_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 0])
    member = torch.tensor([0, 0, 1, 2, 2])  # members' rewards 0.5, 0.5, 1.0
    grpo = member_advantages(rewards, GRPOAdvantage(eps=0.0), groups, member)
    mean, std = 2.0 / 3, math.sqrt(((0.5 - 2 / 3) ** 2 * 2 + (1 / 3) ** 2) / 2)
    assert grpo.tolist() == pytest.approx([(r - mean) / std for r in (1.0, 0.0, 0.5, 2.0, 0.0)])
    rloo = member_advantages(rewards, RLOOAdvantage(), groups, member)
    assert rloo.tolist() == pytest.approx([1.0 - 0.75, 0.0 - 0.75, 0.5 - 0.75, 2.0 - 0.5, 0.0 - 0.5])
    # one branch per member: plain GRPO
    plain = member_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0]), GRPOAdvantage(), torch.zeros(4, dtype=torch.long),
                              torch.arange(4))
    assert plain.tolist() == pytest.approx([-0.866, -0.866, 0.866, 0.866], abs=1e-3)
    with pytest.raises(ValueError, match="n >= 2"):  # a lone tree has no baseline
        member_advantages(rewards[:2], GRPOAdvantage(), groups[:2], member[:2])
    assert ObjectiveConfig().tree.max_branches == 5

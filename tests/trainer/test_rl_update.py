"""The RL update's structure: minibatches make the clip bind, RL starts with fresh optimizer
moments and a learning-rate warm-up, and a KL penalty in the reward does not pass through the
group std."""

from __future__ import annotations

import pytest
import torch

from cells.rl.objectives import KLInReward, ObjectiveConfig
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory

torch.set_num_threads(1)


def _batch(learner, rewards=(1.0, 0.0)):
    return [trajectory(learner, PROMPT, GOOD, rewards[0], sid="a"),
            trajectory(learner, PROMPT, BAD, rewards[1], sid="b"),
            trajectory(learner, PROMPT, GOOD[:2] + BAD[2:], rewards[0], sid="c"),
            trajectory(learner, PROMPT, BAD[:2] + GOOD[2:], rewards[1], sid="d")]


def test_the_clip_binds_from_the_second_minibatch():
    learner = small_learner(lr=5e-2, minibatches=2)
    m = learner.rl_step(_batch(learner, rewards=(10.0, -10.0)))
    assert m["num_minibatches"] == 2 and learner.step == 2 and learner.version == 1
    assert m["clip_frac_first"] == 0.0  # r_t == 1 exactly at lp_prox
    assert m["clip_frac_after_first"] > 0.0 and m["clip_frac"] > 0.0
    assert m["approx_kl"] > 0.0


def test_one_minibatch_never_clips():
    learner = small_learner(lr=5e-2, minibatches=1)
    m = learner.rl_step(_batch(learner, rewards=(10.0, -10.0)))
    assert m["clip_frac"] == 0.0 and m["num_minibatches"] == 1


def test_rl_starts_with_fresh_moments_and_a_learning_rate_warmup():
    learner = small_learner(lr=1e-2, minibatches=2, lr_warmup_steps=4)
    learner.sft_step([(PROMPT + GOOD, [0] * len(PROMPT) + [1] * len(GOOD))])
    assert learner.optimizer.state  # warm-up moments
    learner.start_rl()
    assert not learner.optimizer.state and learner.rl_start_step == learner.step
    m = learner.rl_step(_batch(learner))
    states = list(learner.optimizer.state.values())
    assert states and all(int(s["step"]) == 2 for s in states)  # counted from RL's first step
    assert m["lr_effective"] == 1e-2 * 2 / 4 and learner.lr == 1e-2
    learner.rl_step(_batch(learner))
    learner.rl_step(_batch(learner))
    assert learner.last_lr == 1e-2


def test_kl_in_the_reward_does_not_pass_through_the_group_std():
    """Equal task rewards in a group: the advantage is only -beta·KL per sequence (small),
    not KL noise blown up to unit size by the group std."""
    coef = 0.01
    learner = small_learner(objective=ObjectiveConfig(kl=KLInReward(coef=coef)))
    other = small_learner()
    learner.set_reference({k: v.detach() + 0.05 * torch.randn_like(v) for k, v in other.params.items()})
    batch = _batch(learner, rewards=(1.0, 1.0))
    expected = []  # coef·sum_t M·k1 with k1 = lp_prox − lp_ref (on-policy: weights 1)
    for t in batch:
        lp, ref = learner.logprobs(t["token_ids"]), learner.logprobs(t["token_ids"], "reference")
        mask = torch.tensor(t["loss_mask"][1:], dtype=torch.bool)
        expected.append(abs(coef * float((lp - ref)[mask].sum())))
    m = learner.rl_step(batch)
    assert m["adv_abs_mean"] == 0.0  # the task advantage
    want = sum(expected) / len(expected)
    assert 0.0 < m["adv_seq_abs_mean"] < 0.2
    assert abs(m["adv_seq_abs_mean"] - want) < 1e-4 * max(1.0, want), (m["adv_seq_abs_mean"], want)


def test_rl_begins_at_the_warmed_up_policy():
    """The trainer's start of RL: the KL reference and the EWMA copy are the warmed-up
    weights (not the initial ones), and the warm-up's moments are gone."""

    from cells.rl.sft import begin_rl

    learner = small_learner(objective=ObjectiveConfig(kl=KLInReward(coef=0.01)))
    initial = {k: v.detach().clone() for k, v in learner.params.items()}
    for _ in range(2):
        learner.sft_step([(PROMPT + GOOD, [0] * len(PROMPT) + [1] * len(GOOD))])
    assert any(not torch.equal(initial[k], learner.params[k].detach()) for k in initial)
    begin_rl(learner)  # what the warm-up's cell runs at its end
    for k, p in learner.params.items():
        assert torch.equal(learner.reference[k], p.detach()) and torch.equal(learner.ewma.params[k], p.detach())
    assert not learner.optimizer.state and learner.version == 1 and learner.rl_start_step == learner.step


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_learning_rate_schedules_after_the_warm_up(schedule):
    """Warm-up 2 steps, then the schedule over 10 RL optimizer steps down to 0.1 of the rate;
    the factors by hand."""
    import math

    learner = small_learner(lr=1e-2, minibatches=1, lr_warmup_steps=2, lr_schedule=schedule, lr_total_steps=10,
                            lr_min_ratio=0.1)
    learner.start_rl()
    got = []
    for _ in range(12):
        got.append(learner.lr_scale())
        learner.step += 1
    want = [0.5, 1.0]
    for k in range(3, 13):
        p = min(1.0, (k - 2) / 8)
        decay = {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p}[schedule]
        want.append(1.0 if schedule == "constant" else 0.1 + 0.9 * decay)
    assert got == pytest.approx(want)
    m = learner.rl_step(_batch(learner))  # the optimizer step uses it
    assert m["lr_effective"] == pytest.approx(1e-2 * want[-1])

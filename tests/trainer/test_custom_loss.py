"""A loss of one's own (`objective.loss: "package.module:function"`): what it receives, what it
must return, where its name may come from, and that it trains the toy task."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.learner import Learner
from cells.rl.objectives import ObjectiveConfig, decoupled_ppo_loss
from cells.rl.objectives.custom import LossInputs
from cells.trainer.toy_task import TaskSpec, ToySampler, heldout_eval, make_episodes
from cells.trainer.warmup import run_warmup
from cells.training.protocol import build_learner, hyper, local_objective
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory

torch.set_num_threads(1)

F64 = torch.float64
EXAMPLE = "cells.rl.objectives.custom:reinforce_with_weights"
SEEN: list[LossInputs] = []


def recording(x: LossInputs) -> torch.Tensor:
    """The built-in sum with the inputs kept for the test."""
    SEEN.append(x)
    return -(x.scale * x.weight * x.advantages * x.log_ratio.exp()).sum()


def not_scalar(x: LossInputs) -> torch.Tensor:
    return -(x.scale * x.advantages * x.log_ratio.exp())


def undeclared(x: LossInputs):
    return -(x.scale * x.log_ratio).sum(), {"surprise": 1.0}


NOT_CALLABLE = 3


def _case(delta: float):
    g = torch.Generator().manual_seed(3)
    lp_prox = -torch.rand(3, 5, generator=g, dtype=F64) - 0.5
    lp_theta = (lp_prox + delta * torch.randn(3, 5, generator=g, dtype=F64)).requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    return lp_theta, lp_prox, mask, torch.tensor([1.0, -0.7, 0.4], dtype=F64)


def _loss(cfg, delta):
    lp_theta, lp_prox, mask, adv = _case(delta)
    loss, m = decoupled_ppo_loss(lp_theta, lp_prox, lp_prox.clone(), adv, mask, cfg, lp_old=lp_prox.clone())
    (g,) = torch.autograd.grad(loss, lp_theta)
    return loss.detach(), g, m


def test_the_example_equals_ppo_on_policy_and_drops_the_clip_off_policy():
    for delta, same in ((0.0, True), (0.5, False)):  # off-policy: the clip binds, the example has none
        ppo = _loss(ObjectiveConfig(), delta)
        mine = _loss(ObjectiveConfig(loss=EXAMPLE), delta)
        assert torch.allclose(ppo[1], mine[1]) == same and torch.isclose(ppo[0], mine[0]) == same
        assert mine[2]["loss_negative_tokens"] == 5.0  # the row with A < 0 (metrics: sums)
        assert ppo[2]["clip_frac"] == mine[2]["clip_frac"]  # the built-in metrics stay


def test_the_loss_receives_the_documented_inputs():
    learner = small_learner(objective=ObjectiveConfig(loss="tests.trainer.test_custom_loss:recording"))
    trajs = [trajectory(learner, PROMPT, GOOD, 1.0, sid="a"), trajectory(learner, PROMPT, BAD, 0.0, sid="b")]
    seen = importlib.import_module("tests.trainer.test_custom_loss").SEEN  # the copy the loss lives in
    seen.clear()
    learner.rl_step(trajs)
    x = seen[0]
    assert x.lp_theta.requires_grad and not any(t.requires_grad for t in (x.lp_prox, x.lp_behav, x.lp_old, x.scale))
    assert x.mask.sum() == len(GOOD) + len(BAD) and bool((x.keep <= x.mask).all())
    assert float(x.scale[x.keep].sum()) == pytest.approx(1.0)  # token mean: 1/N0 on each kept token
    assert set(x.versions_behind[x.mask].tolist()) == {0} and set(x.versions_behind[~x.mask].tolist()) == {-1}
    assert not x.missing.any()
    torch.testing.assert_close(x.lp_old[x.mask], x.lp_behav[x.mask])  # on-policy: exact old = behaviour
    assert sorted(set(x.advantages[x.mask].tolist())) == pytest.approx([-0.7071, 0.7071], abs=1e-3)


@pytest.mark.parametrize("name,match", [
    ("tests.trainer.test_custom_loss:not_scalar", "scalar tensor"),
    ("tests.trainer.test_custom_loss:undeclared", "undeclared metrics"),
    ("tests.trainer.test_custom_loss:NOT_CALLABLE", "no callable"),
])
def test_a_malformed_loss_is_a_clear_error(name, match):
    with pytest.raises(ValueError, match=match):
        _loss(ObjectiveConfig(loss=name), 0.1)


def test_a_loss_name_is_never_taken_from_the_wire():
    """A cell builds the coordinator's learner only when the loss named in the hyper-parameters
    (which arrived over the network) is its own configuration's."""
    learner = small_learner(objective=ObjectiveConfig(loss=EXAMPLE))
    h = json.loads(json.dumps(hyper(learner)))  # what a cell receives
    meta = {"entries": [{"kind": "param", "name": k, "shape": list(p.shape)} for k, p in learner.params.items()]}
    with pytest.raises(ValueError, match="not this cell's configured loss"):
        build_learner(h, meta)
    with pytest.raises(ValueError, match="not this cell's configured loss"):
        local_objective(h, "tests.trainer.test_custom_loss:recording")
    assert build_learner(h, meta, local_loss=EXAMPLE).objective.loss == EXAMPLE
    plain = json.loads(json.dumps(hyper(small_learner())))
    assert local_objective(plain, None).loss is None
    with pytest.raises(ValueError):  # a name that is not "module:function" is refused by the schema
        ObjectiveConfig(loss="os.system('x')")


@pytest.mark.slow
def test_a_custom_loss_trains_the_toy_task():
    """The trainer's warm-up, then four RL steps of the example loss on the toy task (exact old
    log-probs from a batch-invariant engine): the held-out greedy score rises well past the
    warmed-up policy's; the same run at learning rate 0 (the control) leaves it where it was."""
    spec, task = PRESETS["toy"], TaskSpec(seed=0)
    warm = Learner(spec, init_weights(spec, 0, 0.1), lr=3e-3, tile=4, seed=0)
    run_warmup(warm, steps=300, batch_size=16, num_demos=512, seed=0, spec=task)
    state, before = warm.state_dict(), heldout_eval(spec, warm.weights(), task, 32)["reward"]
    after, kept = {}, {}
    for lr in (1e-3, 0.0):
        learner = Learner(spec, state["params"], lr=lr, objective=ObjectiveConfig(loss=EXAMPLE), tile=4, seed=0,
                          minibatches=2, lr_warmup_steps=4)
        learner.load_state_dict(state)
        learner.set_reference()
        learner.start_rl()
        learner.lr = lr
        sampler = ToySampler(spec, learner.weights(), version=learner.version, row_tile=4)
        learner.tile = sampler.engine.tile
        try:
            for step in range(4):
                trajs, _ = sampler.rollouts(make_episodes(task, 8, start=step * 8), samples=4, tag=f"rl{step}-",
                                            max_turns=6)
                m = learner.rl_step(trajs)  # the guard on: an unclipped step past it is rejected
                assert m["loss_negative_tokens"] > 0
                kept[lr] = kept.get(lr, 0) + int(not m["update_rejected"])
                sampler.load(learner.version, learner.weights())
        finally:
            sampler.close()
        after[lr] = heldout_eval(spec, learner.weights(), task, 32)["reward"]
    assert after[0.0] == before
    assert after[1e-3] >= before + 0.2 and kept[1e-3] >= 3, (before, after, kept)

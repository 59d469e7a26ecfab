"""The learner: bitwise first update against the cells' scoring, the RL step, warm-up, resume."""

from __future__ import annotations

import io

import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.model import init_weights, prepare, token_logprobs
from cells.engine.embedded.model_spec import PRESETS, ModelSpec
from cells.rl.learner import Learner
from cells.rl.objectives import KLInLoss, KLInReward, ObjectiveConfig, decoupled_ppo_loss
from scheduler.contract.config.engine import EmbeddedEngineConfig

torch.set_num_threads(1)

SMALL = ModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=512, max_position=256,
                  output_id_ranges=((0, 40), (500, 505)))


def small_learner(guard: bool = False, **kw) -> Learner:
    """The tiny model moves by nats in one step at these learning rates: the trust-region
    guard (cells/rl/guard.py) is off unless `guard`."""
    kw.setdefault("lr", 1e-2)
    objective = kw.pop("objective", None) or ObjectiveConfig()
    if not guard:
        objective = objective.model_copy(update={"max_update_kl": None})
    return Learner(SMALL, init_weights(SMALL, 0, 0.1), objective=objective, **kw)


def trajectory(learner: Learner, prompt: list[int], completion: list[int], reward: float,
               group: str | None = "g", sid: str = "s", provenance: str | None = "exact"
               ) -> dict:
    """An on-policy trajectory in the store's format: behaviour and old log-probs are the
    learner's own (so r_d = r_stale = 1)."""
    ids = prompt + completion
    lp = learner.logprobs(ids).tolist()
    n, p = len(ids), len(prompt)
    sampled = [i >= p for i in range(n)]
    return {
        "id": sid, "state": "finished", "reward": reward, "group_id": group,
        "segment_starts": [0], "token_ids": ids, "loss_mask": [int(m) for m in sampled],
        "logprobs": [lp[i - 1] if m else None for i, m in enumerate(sampled)],
        "versions": [learner.version if m else None for m in sampled],
        "old_logprobs": [lp[i - 1] if m and provenance == "exact" else None
                         for i, m in enumerate(sampled)],
        "provenance": [provenance if m else None for m in sampled],
    }


PROMPT = [3, 17, 8, 500, 22, 9]
GOOD, BAD = [5, 6, 7, 501], [30, 31, 32, 501]


def seq_logprob(learner: Learner, completion: list[int]) -> float:
    return float(learner.logprobs(PROMPT + completion)[len(PROMPT) - 1 :].sum())


# -- bitwise agreement with the cells ------------------------------------------------------------
def test_first_update_is_bitwise_equal_to_cells_scoring():
    spec = PRESETS["toy"]
    w = init_weights(spec, 3, 0.1)
    engine = EmbeddedEngine(EmbeddedEngineConfig(batch_invariant=True), spec=spec, weights=w)
    learner = Learner(spec, w, lr=1e-3, tile=engine.tile)
    g = torch.Generator().manual_seed(0)
    out_ids = torch.tensor(spec.output_ids())
    for n in (2, 7, 64, 203):
        ids = out_ids[torch.randint(len(out_ids), (n,), generator=g)].tolist()
        ids[0] = 151644  # <|im_start|>: an input-only token outside the output ids
        cells = engine.score(ids)
        mine = learner.logprobs(ids)
        plain = token_logprobs(prepare(spec, learner.params), torch.tensor(ids), 1.0, engine.tile)
        assert torch.equal(mine, cells) and torch.equal(plain.detach(), cells)


def test_rl_step_on_sampled_trajectories_reports_bitwise_and_staleness():
    """Trajectories sampled and scored by the batch-invariant engine through the gateway:
    the first update reproduces every old log-prob; a second pass on them is one version
    stale."""
    from cells.trainer.toy_task import TaskSpec, ToySampler, make_episodes

    spec = PRESETS["toy"]
    w = init_weights(spec, 1, 0.1)
    sampler = ToySampler(spec, w, version=5, max_tokens=12, threads=4)
    try:
        trajs, _ = sampler.rollouts(make_episodes(TaskSpec(), 2), samples=2, max_turns=2)
    finally:
        sampler.close()
    for t in trajs:
        t["reward"] = float(len(t["token_ids"]) % 3)  # any rewards that differ in a group
    # the guard off: a random-init policy moves far in one step (this checks a kept update)
    learner = Learner(spec, w, lr=1e-3, tile=sampler.engine.tile, version=5,
                      objective=ObjectiveConfig(max_update_kl=None))
    m = learner.rl_step(trajs)
    assert m["frac_bitwise_equal"] == 1.0 and m["staleness_mean"] == 0.0
    assert m["mean_r_d"] == 1.0 and m["mean_r_stale"] == 1.0 and m["frac_masked"] == 0.0
    assert m["tokens_exact"] == m["num_tokens"] > 0 and m["tokens_missing"] == 0
    assert learner.version == 6
    m2 = learner.rl_step(trajs)
    assert m2["staleness_mean"] == 1.0 and m2["frac_bitwise_equal"] < 1.0
    assert m2["mean_r_stale"] != 1.0


def test_compacted_forward_matches_the_full_model():
    learner = small_learner()
    ids = torch.tensor(PROMPT + GOOD)
    (lp,), w, rows = learner._logprobs(learner.params, [ids], grad=True)
    full = token_logprobs(prepare(SMALL, learner.params), ids, 1.0, learner.tile)
    assert torch.equal(lp[1:].detach(), full.detach())
    lp[1:].sum().backward()
    learner._accumulate_rows(w, rows)
    mine = {k: p.grad.clone() for k, p in learner.params.items()}
    for p in learner.params.values():
        p.grad = None
    full.sum().backward()
    for k, p in learner.params.items():
        torch.testing.assert_close(mine[k], p.grad, rtol=1e-5, atol=1e-7)


# -- the RL step -----------------------------------------------------------------------------
def test_rl_step_moves_toward_the_rewarded_completion():
    learner = small_learner()
    trajs = [trajectory(learner, PROMPT, GOOD, 1.0, sid="a"),
             trajectory(learner, PROMPT, BAD, 0.0, sid="b")]
    before = {"good": seq_logprob(learner, GOOD), "bad": seq_logprob(learner, BAD)}
    lp_prox = [learner.logprobs(t["token_ids"]) for t in trajs]
    m = learner.rl_step(trajs)
    assert m["num_trajectories"] == 2 and m["frac_bitwise_equal"] == 1.0
    assert seq_logprob(learner, GOOD) > before["good"]
    assert seq_logprob(learner, BAD) < before["bad"]
    # the surrogate loss at the new parameters is below its value at the old ones
    lp_new = [learner.logprobs(t["token_ids"]) for t in trajs]
    mask = torch.tensor([t["loss_mask"][1:] for t in trajs], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    old = torch.stack(lp_prox)
    cfg = ObjectiveConfig()
    at_old, _ = decoupled_ppo_loss(old, old, old, adv, mask, cfg, lp_old=old)
    at_new, _ = decoupled_ppo_loss(torch.stack(lp_new), old, old, adv, mask, cfg, lp_old=old)
    assert float(at_new) < float(at_old)
    assert m["loss"] == pytest.approx(float(at_old), abs=1e-6)


def test_lr_zero_leaves_the_weights_unchanged():
    learner = small_learner(lr=0.0)
    w0 = learner.weights()
    learner.rl_step([trajectory(learner, PROMPT, GOOD, 1.0, sid="a"),
                     trajectory(learner, PROMPT, BAD, 0.0, sid="b")])
    assert all(torch.equal(learner.params[k].detach(), w0[k]) for k in w0)
    assert learner.version == 1


def test_missing_and_unscored_old_logprobs_use_the_ewma_stand_in():
    learner = small_learner()
    trajs = [trajectory(learner, PROMPT, GOOD, 1.0, sid="a", provenance="missing"),
             trajectory(learner, PROMPT, BAD, 0.0, sid="b", provenance=None),
             trajectory(learner, PROMPT, [7, 7, 501], 0.5, sid="c")]
    m = learner.rl_step(trajs)
    assert m["tokens_missing"] == len(GOOD) and m["tokens_unscored"] == len(BAD)
    assert m["tokens_exact"] == 3 and m["num_missing"] == len(GOOD) + len(BAD)
    # a fresh average equals the parameters: the stand-in reproduces lp_prox
    assert m["mean_r_stale_missing"] == 1.0 and m["frac_missing_kept"] == 1.0


def test_segments_groups_and_singletons():
    learner = small_learner()
    a = trajectory(learner, PROMPT, GOOD, 1.0, sid="a")
    b = trajectory(learner, PROMPT, BAD, 0.0, sid="b")
    two = trajectory(learner, PROMPT + GOOD + PROMPT, BAD, 0.5, sid="c")
    two["segment_starts"] = [0, len(PROMPT + GOOD)]
    two["loss_mask"][len(PROMPT) : len(PROMPT + GOOD)] = [1] * len(GOOD)
    two["logprobs"][len(PROMPT) : len(PROMPT + GOOD)] = [-1.0] * len(GOOD)
    two["old_logprobs"][len(PROMPT) : len(PROMPT + GOOD)] = [-1.0] * len(GOOD)
    two["provenance"][len(PROMPT) : len(PROMPT + GOOD)] = ["exact"] * len(GOOD)
    lone = trajectory(learner, PROMPT, GOOD, 1.0, group="alone", sid="d")
    m = learner.rl_step([a, b, two, lone])
    assert m["num_trajectories"] == 3 and m["num_dropped"] == 1
    assert m["num_sequences"] == 4  # a, b and the two segments of c
    with pytest.raises(ValueError, match="two or more"):
        learner.rl_step([lone])


@pytest.mark.parametrize("kl", [KLInLoss(coef=0.1), KLInReward(coef=0.1)])
def test_kl_to_the_reference(kl):
    learner = small_learner(objective=ObjectiveConfig(kl=kl))
    trajs = [trajectory(learner, PROMPT, GOOD, 1.0, sid="a"),
             trajectory(learner, PROMPT, BAD, 0.0, sid="b")]
    m = learner.rl_step(trajs)  # the reference is the initial weights: KL 0
    assert m["kl"] == 0.0
    m = learner.rl_step(trajs)
    assert m["kl"] > 0.0 and m["staleness_mean"] == 1.0


# -- warm-up and checkpoints -------------------------------------------------------------------
def test_sft_step_lowers_the_loss():
    learner = small_learner(lr=3e-3)
    batch = [(PROMPT + GOOD, [0] * len(PROMPT) + [1] * len(GOOD))] * 2
    first = learner.sft_step(batch)["loss"]
    for _ in range(5):
        last = learner.sft_step(batch)["loss"]
    assert last < first and learner.version == 6
    with pytest.raises(ValueError, match="output ids"):
        learner.sft_step([([1, 2, 300], [0, 1, 1])])


def test_warmup_on_demos():
    from cells.trainer.toy_task import TaskSpec
    from cells.trainer.warmup import run_warmup

    spec = PRESETS["toy"]
    learner = Learner(spec, init_weights(spec, 0, 0.1), lr=3e-3, seed=0)
    rep = run_warmup(learner, steps=3, batch_size=2, num_demos=4, seed=0, spec=TaskSpec())
    assert rep["steps"] == 3 and rep["num_demos"] == 4 and len(rep["losses"]) == 3
    assert rep["final_loss"] < rep["first_loss"]


def test_state_dict_round_trips_and_resumes_identically():
    learner = small_learner(objective=ObjectiveConfig(kl=KLInLoss()))
    trajs = [trajectory(learner, PROMPT, GOOD, 1.0, sid="a"),
             trajectory(learner, PROMPT, BAD, 0.0, sid="b")]
    learner.rl_step(trajs, cursor=17)
    torch.randint(10, (3,), generator=learner.generator)
    buf = io.BytesIO()
    torch.save(learner.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    other = Learner(SMALL, init_weights(SMALL, 9, 0.1), lr=0.5, objective=learner.objective)
    other.load_state_dict(state)
    assert (other.version, other.step, other.cursor, other.lr) == (1, 1, 17, learner.lr)
    for k in learner.params:
        assert torch.equal(other.params[k].detach(), learner.params[k].detach())
        assert torch.equal(other.reference[k], learner.reference[k])
        assert torch.equal(other.ewma.params[k], learner.ewma.params[k])
    assert torch.equal(torch.randint(1000, (4,), generator=other.generator),
                       torch.randint(1000, (4,), generator=learner.generator))
    ma, mb = learner.rl_step(trajs), other.rl_step(trajs)
    assert ma["loss"] == mb["loss"]
    for k in learner.params:  # identical optimizer state: identical next step
        assert torch.equal(other.params[k].detach(), learner.params[k].detach())
    with pytest.raises(ValueError, match="another model spec"):
        Learner(PRESETS["toy"], init_weights(PRESETS["toy"], 0), lr=1.0).load_state_dict(state)

"""The highest RL learning rate that does not collapse the toy task, before and after RL starts
with fresh Adam moments and a learning-rate warm-up.

One warm-up (the trainer's: supervised steps on the teacher's demonstrations), then for each
learning rate of a grid and each of two RL starts, a short RL run in-process from that same
warmed-up learner (ToySampler: a batch-invariant EmbeddedEngine behind the in-process
gateway, exact old log-probs; the trainer's objective and minibatches):
- `carry` (before): the warm-up's Adam moments carried into RL and the full learning rate
  from the first optimizer step (the trainer before the reset);
- `reset` (after): the moments dropped when RL starts and the learning rate ramped up over
  `lr_warmup_steps` optimizer steps (`Learner.start_rl`, the trainer's default).
A run collapses when its held-out greedy score ends more than COLLAPSE_DROP below the
warmed-up policy's, when its batch reward over the last two steps ends more than COLLAPSE_DROP
below the first step's, when the KL between consecutive policies (`approx_kl`: k3 of the
policy at an update's start against the policy after each of its minibatches, per sampled
token) passes KL_MAX in any step (the run stops there: the sampled tokens lost nearly all
their probability), or when a loss or gradient is not finite. `approx_kl` is a mean over
tokens and a few tokens whose probability falls far move it a lot: single steps between 0.5
and a few nats/token were seen in runs whose held-out score then kept rising, so the
threshold is set where a policy has moved away from what it sampled, and the task scores
decide below it.
Fields:
- grid: learning rates tried; steps, groups, samples (sessions per step = groups x samples),
  minibatches, lr_warmup_steps, heldout (episodes), collapse_drop, kl_max;
- heldout_warmup: greedy held-out score of the warmed-up policy;
- highest_stable_lr_before / highest_stable_lr_after: the largest learning rate of the grid
  whose `carry` / `reset` run did not collapse (null: none);
- runs: per run lr, start, heldout_last, reward_first / reward_last (batch means of the first
  and last step), approx_kl_max, approx_kl_first (first step), approx_kl (every step),
  grad_norm_first, steps_run, collapsed, reason;
- wall_s.
"""

from __future__ import annotations

import math
import time

from common import finish, parse_args, set_threads

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.learner import Learner
from cells.rl.objectives import ObjectiveConfig
from cells.trainer.toy_task import TaskSpec, ToySampler, heldout_eval, make_episodes
from cells.trainer.warmup import run_warmup

COLLAPSE_DROP = 0.1
"""A run collapsed when its held-out score ends this far below the warmed-up policy's."""
KL_MAX = 10.0
"""...or when one update moves the policy more than this (nats per sampled token, k3)."""
SEED = 0
TILE = 4
MAX_TURNS = 6


def warm(steps: int) -> tuple[object, dict, float]:
    """The trainer's warm-up; returns (spec, learner state, held-out score of the warm policy)."""
    spec = PRESETS["toy"]
    learner = Learner(spec, init_weights(spec, SEED, 0.1), lr=3e-3, tile=TILE, seed=SEED)
    run_warmup(learner, steps=steps, batch_size=16, num_demos=512, seed=SEED, spec=TaskSpec(seed=SEED))
    return spec, learner.state_dict(), heldout_eval(spec, learner.weights(), TaskSpec(seed=SEED), HELDOUT)["reward"]


def rl_run(spec: object, state: dict, lr: float, reset: bool, p: dict, heldout_warmup: float) -> dict:
    """A short RL run from the warmed-up `state` at learning rate `lr`."""
    # the guard off: this measures what the optimizer's start does to a run, not the rollback
    learner = Learner(spec, state["params"], lr=lr, objective=ObjectiveConfig(max_update_kl=None), tile=TILE, seed=SEED,
                      minibatches=p["minibatches"], lr_warmup_steps=p["lr_warmup_steps"] if reset else 0)
    learner.load_state_dict(state)  # parameters and the warm-up's optimizer moments
    learner.set_reference()
    if reset:
        learner.start_rl()
    else:
        learner.version = 1
    learner.lr = lr
    task, rows, reason = TaskSpec(seed=SEED), [], None
    sampler = ToySampler(spec, learner.weights(), version=learner.version, row_tile=TILE)
    learner.tile = sampler.engine.tile
    try:
        for step in range(p["steps"]):
            eps = make_episodes(task, p["groups"], start=step * p["groups"])
            trajs, _ = sampler.rollouts(eps, samples=p["samples"], tag=f"rl{step}-", max_turns=MAX_TURNS)
            m = learner.rl_step(trajs)
            rows.append(m)
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                reason = f"non-finite loss or gradient at step {step}"
                break
            if m["approx_kl"] > KL_MAX:
                reason = f"approx_kl {m['approx_kl']:.3g} > {KL_MAX} at step {step}"
                break
            sampler.load(learner.version, learner.weights())
    finally:
        sampler.close()
    heldout = heldout_eval(spec, learner.weights(), task, HELDOUT)["reward"]
    last = sum(r["reward_mean"] for r in rows[-2:]) / len(rows[-2:])
    if reason is None and heldout < heldout_warmup - COLLAPSE_DROP:
        reason = f"held-out {heldout:.3f} < warm-up {heldout_warmup:.3f} - {COLLAPSE_DROP}"
    elif reason is None and last < rows[0]["reward_mean"] - COLLAPSE_DROP:
        reason = f"batch reward {last:.3f} (last two steps) < first step {rows[0]['reward_mean']:.3f} - {COLLAPSE_DROP}"
    return {"lr": lr, "start": "reset" if reset else "carry", "heldout_last": round(heldout, 4),
            "reward_first": round(rows[0]["reward_mean"], 4), "reward_last": round(rows[-1]["reward_mean"], 4),
            "approx_kl_max": round(max(r["approx_kl"] for r in rows), 5),
            "approx_kl_first": round(rows[0]["approx_kl"], 5), "approx_kl": [round(r["approx_kl"], 4) for r in rows],
            "update_kl": [round(r["update_kl"], 4) for r in rows],
            "grad_norm_first": round(rows[0]["grad_norm"], 4),
            "steps_run": len(rows), "collapsed": reason is not None, "reason": reason}


def highest_stable(runs: list[dict], start: str) -> float | None:
    ok = [r["lr"] for r in runs if r["start"] == start and not r["collapsed"]]
    return max(ok) if ok else None


HELDOUT = 32


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    t0 = time.monotonic()
    if args.quick:
        p = {"grid": [2e-3, 4e-3, 8e-3], "steps": 4, "groups": 8, "samples": 4}
    else:
        p = {"grid": [1e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3], "steps": 8, "groups": 8, "samples": 8}
    p.update({"minibatches": 2, "lr_warmup_steps": 4, "heldout": HELDOUT, "collapse_drop": COLLAPSE_DROP,
              "kl_max": KL_MAX, "warmup_steps": 300})
    spec, state, heldout_warmup = warm(p["warmup_steps"])
    if not args.json:
        print({"heldout_warmup": heldout_warmup}, flush=True)
    runs = []
    for lr in p["grid"]:
        for reset in (False, True):
            runs.append(rl_run(spec, state, lr, reset, p, heldout_warmup))
            if not args.json:
                print(runs[-1], flush=True)
    finish({**p, "heldout_warmup": round(heldout_warmup, 4),
          "highest_stable_lr_before": highest_stable(runs, "carry"),
          "highest_stable_lr_after": highest_stable(runs, "reset"),
          "runs": runs, "wall_s": round(time.monotonic() - t0, 1)}, args, "lr_sweep")


if __name__ == "__main__":
    main()

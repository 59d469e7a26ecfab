"""The learnability check: warm-up on demonstrations, then RL against an lr = 0 control.

    python -m cells.trainer.learnability --selfcheck   # a few CPU minutes on one thread

Passes when RL gains at least 0.1 mean reward over the control on the same held-out
episodes and session ids, and the control's weights stay bitwise the warm-up's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cells.rl.learner import Learner
from cells.rl.objectives import GRPOAdvantage, ObjectiveConfig, RLOOAdvantage


@dataclass(frozen=True)
class CheckConfig:
    """Knobs of the learnability check (defaults: a few CPU minutes on one thread)."""

    seed: int = 0
    preset: str = "toy"
    init_std: float = 0.1
    """Initial weight scale: at 0.1 (not the engine's 0.02) the warm-up finds the circuits
    that copy item numbers and codes within ~250 steps."""
    warmup_steps: int = 300
    warmup_batch: int = 16
    warmup_lr: float = 3e-3
    num_demos: int = 512
    rl_steps: int = 10
    rl_lr: float = 2e-3
    groups: int = 16
    """Episodes per RL step (each a GRPO group)."""
    samples: int = 8
    """Sessions per episode."""
    eval_episodes: int = 64
    eval_samples: int = 2
    advantage: str = "grpo"
    """`grpo` or `rloo`."""
    tile: int = 4
    max_turns: int = 6

    def objective(self) -> ObjectiveConfig:
        adv = GRPOAdvantage() if self.advantage == "grpo" else RLOOAdvantage()
        return ObjectiveConfig(advantage=adv)


def evaluate(sampler: Any, episodes: Sequence[Any], samples: int, tag: str, max_turns: int
             ) -> dict[str, float]:
    """Mean reward and success rate of the served weights on fixed episodes and session ids
    (the sampler is deterministic: equal weights give equal rollouts)."""
    _, stats = sampler.rollouts(episodes, samples=samples, tag=tag, max_turns=max_turns)
    n = len(stats)
    return {"reward": sum(s["reward"] for s in stats) / n,
            "solved": sum(s["solved"] for s in stats) / n}


def selfcheck(cfg: CheckConfig | None = None, log: Any = print) -> dict[str, Any]:
    """Warm-up, then RL against the lr = 0 control, on the toy task (see `rl_check`)."""
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS
    from cells.trainer.toy_task import TaskSpec
    from cells.trainer.warmup import run_warmup

    cfg = cfg or CheckConfig()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    spec = PRESETS[cfg.preset]
    learner = Learner(spec, init_weights(spec, cfg.seed, cfg.init_std), lr=cfg.warmup_lr,
                      objective=cfg.objective(), tile=cfg.tile, seed=cfg.seed)
    warm = run_warmup(learner, steps=cfg.warmup_steps, batch_size=cfg.warmup_batch,
                      num_demos=cfg.num_demos, seed=cfg.seed, spec=TaskSpec(seed=cfg.seed))
    log(json.dumps({"warmup_loss_first": round(warm["first_loss"], 4),
                    "warmup_loss_final": round(warm["final_loss"], 4),
                    "warmup_s": round(warm["wall_s"], 1)}))
    out = rl_check(learner, cfg, log)
    out.update({"warmup_final_loss": warm["final_loss"], "warmup_s": warm["wall_s"],
                "wall_s": time.perf_counter() - t0, "config": dict(cfg.__dict__)})
    return out


def rl_check(learner: Learner, cfg: CheckConfig, log: Any = print) -> dict[str, Any]:
    """RL from a warmed-up learner (its weights, version and optimizer state) versus the
    lr = 0 control.

    The control is the same learner restored from `state_dict()` with lr = 0, stepped on
    the first RL batch: its weights stay bitwise equal to the warm-up weights (checked), so
    every later control batch would be sampled from those same weights, and its final
    evaluation is that of the warm-up weights on the same episodes and session ids (the
    sampler is deterministic)."""
    from cells.trainer.toy_task import TaskSpec, ToySampler, make_episodes

    task = TaskSpec(seed=cfg.seed)
    learner.set_reference()  # KL (when configured) anchors at the warmed-up policy
    learner.start_rl()  # the warm-up's moments describe another objective
    w0, v0 = learner.weights(), learner.version
    control = Learner(learner.spec, w0, lr=0.0, objective=learner.objective, tile=learner.tile)
    control.load_state_dict(learner.state_dict())
    control.lr = 0.0
    learner.lr = cfg.rl_lr
    sampler = ToySampler(learner.spec, w0, version=v0, row_tile=cfg.tile)
    # The engine falls back to single rows when its start-up probe fails: score as it does.
    learner.tile = control.tile = sampler.engine.tile
    try:
        evals = make_episodes(task, cfg.eval_episodes, start=10_000_000)
        t_eval = time.perf_counter()
        before = evaluate(sampler, evals, cfg.eval_samples, "eval-", cfg.max_turns)
        log(json.dumps({"warmup_eval": before, "eval_s": round(time.perf_counter() - t_eval, 1)}))
        t_rl = time.perf_counter()
        history = []
        for step in range(cfg.rl_steps):
            eps = make_episodes(task, cfg.groups, start=step * cfg.groups)
            trajs, _ = sampler.rollouts(eps, samples=cfg.samples, tag=f"rl{step}-",
                                        max_turns=cfg.max_turns)
            if step == 0:
                control_metrics = control.rl_step(trajs)
            m = learner.rl_step(trajs)
            sampler.load(learner.version, learner.weights())
            row = {"rl_step": step, "batch_reward": round(m["reward_mean"], 4),
                   "loss": round(m["loss"], 5), "bitwise": m["frac_bitwise_equal"],
                   "staleness": m["staleness_mean"], "tokens": m["num_tokens"],
                   "grad_norm": round(m["grad_norm"], 3), "step_s": round(m["step_s"], 2)}
            history.append(row)
            log(json.dumps(row))
        rl_s = time.perf_counter() - t_rl
        unchanged = all(torch.equal(control.params[k].detach(), w0[k]) for k in w0)
        after = evaluate(sampler, evals, cfg.eval_samples, "eval-", cfg.max_turns)
    finally:
        sampler.close()
    return {
        "warmup_reward": before["reward"],
        "control_reward": before["reward"],
        "rl_reward": after["reward"],
        "gain_over_control": after["reward"] - before["reward"],
        "warmup_solved": before["solved"],
        "rl_solved": after["solved"],
        "control_weights_unchanged": unchanged,
        "control_bitwise_first_step": control_metrics["frac_bitwise_equal"],
        "rl_s": rl_s,
        "history": history,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--selfcheck", action="store_true", help="run the learnability check")
    for f in CheckConfig.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    if not args.selfcheck:
        p.print_help()
        return
    cfg = CheckConfig(**{f: getattr(args, f) for f in CheckConfig.__dataclass_fields__})
    out = selfcheck(cfg)
    print(json.dumps({k: v for k, v in out.items() if k != "history"}, indent=1))
    if out["gain_over_control"] < 0.1 or not out["control_weights_unchanged"]:
        raise SystemExit("learnability check failed")


if __name__ == "__main__":
    main()

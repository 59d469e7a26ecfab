"""Supervised warm-up on the toy task's teacher demonstrations, so that RL starts from a policy
that often succeeds (a random-init model never emits a well-formed tool call).

The demos are token sequences recorded by the gateway logic itself (`demo_token_sequences`),
so the warm-up trains on exactly the token layout sampling later produces. Batches are drawn
with the learner's checkpointed generator: a fixed seed gives the same run. The warm-up runs
the fast (not batch-invariant) kernels: nothing it computes is compared with the cells.

    python -m cells.trainer.warmup --steps 300 --out /tmp/toy-warm.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from cells.rl.learner import Learner
from cells.rl.sft import sft_steps
from cells.trainer.toy_task import TOY_RENDERER, Demonstrator, TaskSpec, demo_token_sequences

WARMUP_TEACHER = Demonstrator(p_skip=0.6)
"""The warm-up's teacher answers `unknown` without using the tool in 60% of its episodes, so
the warmed-up policy has room that only the reward teaches (the skills themselves -- calls,
parallel calls, following redirects, copying codes -- come from the other 40%). The skip is
one decision at the first token, which the group-relative advantage corrects within a few
RL steps. At 40% the RL run's lead over the lr = 0 control after a few steps was about the
size of the batch reward's step-to-step noise (±0.1 with 8 task instances per step), while
the RL learning rate cannot go much higher than 2e-3 without the policy collapsing."""


def toy_demos(seed: int, num_demos: int = 512) -> list[list[list[int]]]:
    """The toy task's warm-up demonstrations as JSON data ([token ids, loss mask] pairs): the
    trainer makes them, a training cell trains on them."""
    return [[list(ids), list(mask)] for ids, mask in demo_token_sequences(num_demos, seed, teacher=WARMUP_TEACHER)]


def run_warmup(
    learner: Learner,
    *,
    steps: int,
    batch_size: int = 16,
    num_demos: int = 512,
    seed: int = 0,
    spec: TaskSpec | None = None,
    renderer: str = TOY_RENDERER,
    teacher: Demonstrator | None = None,
    demos: list[tuple[list[int], list[int]]] | None = None,
    log_every: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """`steps` SFT steps on batches drawn from `num_demos` demonstrations (made from `seed`
    unless given); returns the loss curve and timings."""
    t0 = time.perf_counter()
    if demos is None:
        demos = demo_token_sequences(num_demos, seed, spec=spec, renderer=renderer,
                                     teacher=teacher or WARMUP_TEACHER)
    t_demo = time.perf_counter() - t0

    def step_done(step: int, loss: float) -> None:
        if on_step is not None:
            on_step(step, loss)
        if log_every and ((step - 1) % log_every == 0 or step == steps):
            print(json.dumps({"warmup_step": step - 1, "loss": round(loss, 4)}), flush=True)

    out = sft_steps(learner, demos, steps=steps, batch_size=batch_size, on_step=step_done)
    return {**out, "num_demos": len(demos), "demo_s": t_demo, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="toy")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--demos", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.1)
    p.add_argument("--tile", type=int, default=4)
    p.add_argument("--out", default=None, help="write the weights here (safetensors)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = PRESETS[args.preset]
    learner = Learner(spec, init_weights(spec, args.seed, args.init_std), lr=args.lr,
                      tile=args.tile, seed=args.seed)
    rep = run_warmup(learner, steps=args.steps, batch_size=args.batch, num_demos=args.demos,
                     seed=args.seed, log_every=10)
    if args.out:
        from safetensors.torch import save_file

        save_file(learner.weights(), args.out)
    print(json.dumps({k: v for k, v in rep.items() if k != "losses"}))


if __name__ == "__main__":
    main()

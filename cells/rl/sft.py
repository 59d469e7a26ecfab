"""Supervised steps and the start of RL, as a training rank runs them (the warm-up), and the
start weights a rank builds when nothing is committed yet."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def start_weights(spec: Any, start: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's first weights: the user's Hugging Face directory (`{"kind": "path"}`,
    loaded tensor by tensor into float32) or the seeded initialisation (`{"kind": "init"}`)."""
    if start.get("kind") == "path":
        from cells.engine.embedded.checkpoint import load_checkpoint

        return load_checkpoint(start["path"], spec, dtype=torch.float32)
    if start.get("kind") == "init":
        from cells.engine.embedded.model import init_weights

        return init_weights(spec, int(start["seed"]), float(start["std"]))
    raise ValueError(f"unknown start {start!r}")


def sft_steps(learner: Any, demos: Sequence[tuple[Sequence[int], Sequence[int]]], *, steps: int,
              batch_size: int, on_step: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """`steps` SFT steps on batches of `demos` drawn with the learner's generator (a fixed
    seed gives the same run); returns the loss curve and the time taken."""
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(demos), (batch_size,), generator=learner.generator).tolist()
        m = learner.sft_step([demos[i] for i in idx])
        losses.append(m["loss"])
        if on_step is not None:
            on_step(step + 1, m["loss"])
    tail = losses[-max(1, min(10, len(losses))):] if losses else [float("nan")]
    return {"steps": steps, "batch_size": batch_size, "first_loss": losses[0] if losses else float("nan"),
            "final_loss": sum(tail) / len(tail), "losses": losses, "wall_s": time.perf_counter() - t0}


def begin_rl(learner: Any) -> None:
    """The warmed-up policy is where RL starts: the KL reference anchors at it, the
    optimizer's moments are dropped and the RL learning-rate warm-up starts (`Learner.start_rl`)."""
    learner.set_reference()
    learner.start_rl()

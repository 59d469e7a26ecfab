"""The supervised warm-up on a training rank (a step of kind `warmup`): SFT steps on the
coordinator's demonstrations, progress lines on the store, then RL begins (`begin_rl`)."""

from __future__ import annotations

from typing import Any

from cells.rl.sft import begin_rl, sft_steps
from cells.transport.store import set_json


def warmup(learner: Any, store, prefix: str, spec: dict) -> dict[str, Any]:
    learner.lr = float(spec["lr"])
    total, every = int(spec["steps"]), max(1, int(spec["steps"]) // 20)

    def on_step(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            set_json(store, f"{prefix}/progress", {"step": step, "steps": total, "loss": loss})

    w = sft_steps(learner, [tuple(d) for d in spec["demos"]], steps=total,
                  batch_size=int(spec["batch_size"]), on_step=on_step)
    begin_rl(learner)
    return {"final_loss": w["final_loss"], "optimizer_step": float(learner.step),
            "version": float(learner.version), "update_rejected": 0.0, "wall_s": w["wall_s"]}

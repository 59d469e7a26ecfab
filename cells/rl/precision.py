"""`trainer.precision`: fp32, or bf16 compute and communication over fp32 master weights;
`trainer.activation_checkpointing`.

bf16: each forward runs on a bf16 cast of the fp32 parameters (autograd carries the
gradient back through the cast, so gradients land in fp32 on the fp32 parameters), the
output layer's softmax runs in fp32 (cells/engine/embedded/model.py), and the gradient
all-reduce sends bf16 (half the bytes). AdamW's moments, the reference, the EWMA copy and the
parameters themselves stay fp32. fp32 is the default (on CPU bf16 matmuls are slower, not
faster)."""

from __future__ import annotations

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""Compute dtype by name (None: the parameters' own, fp32)."""


def compute_dtype(name: str) -> torch.dtype | None:
    if name not in PRECISIONS:
        raise ValueError(f"unknown training precision {name!r}: one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


def set_precision(learner, name: str) -> None:
    """Run `learner`'s forwards and gradient sums at precision `name`."""
    learner.compute_dtype = compute_dtype(name)
    learner.precision = name


CHECKPOINTING: dict[str, bool | str] = {"off": False, "half": True, "layer": "layer"}
"""`trainer.activation_checkpointing` as `prepare(checkpoint=...)` takes it."""


def set_checkpointing(learner, mode: str) -> None:
    """Recompute activations in the backward: per layer, per half layer (attention, MLP), or not."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"unknown activation checkpointing {mode!r}: one of {sorted(CHECKPOINTING)}")
    learner.checkpoint, learner.checkpointing = CHECKPOINTING[mode], mode

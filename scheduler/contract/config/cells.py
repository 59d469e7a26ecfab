"""The `cells:` section of the configuration: the cell processes `cellflip up` starts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scheduler.contract.config.base import Strict as _Strict
from scheduler.contract.config.engine import EmbeddedEngineConfig, EngineConfig


class CellsConfig(_Strict):
    """Cell processes started by `cellflip up`."""

    count: int = Field(default=3, gt=0)
    """Number of cell processes."""
    engine: EngineConfig = EmbeddedEngineConfig()
    """Inference engine of every cell."""
    export_root: str = "runs/exports"
    """Where `cellflip export-weights` writes (a path leaving it is refused)."""
    keep_training_memory: Literal["auto", "off"] = "auto"
    """Whether a cell keeps its training state (parameters, AdamW moments, reference, EWMA
    copy, buffers: about six model copies) allocated through a rollout stint, so that its next
    stint joins into warm memory (or needs nothing when no step ran meanwhile). `auto`: where
    the engine does not take the memory back (the embedded engine's host memory), never on an
    engine with role handover (SGLang's GPU memory goes back to the engine); `off`: never (a
    cell's host memory holds only the engine while it serves rollouts)."""
    train_ranks: int = Field(default=1, ge=1, le=64)
    """Training ranks per cell (S): the cell's training state (moments, reference, EWMA copy,
    the guard's snapshot) is sharded S ways across S rank processes, rank i of every training
    cell of a step reducing with rank i of the others (docs/TRAINING.md). One per GPU on a GPU
    node (rank i on `cuda:i`); on CPU S processes over gloo. 1: the one-rank cell, as before."""

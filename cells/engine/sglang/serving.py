"""What an SGLang cell serves, shared by the adapter's parts: the weight version, whether its
weights are complete, whether SGLang decodes, and the GPU memory lent to the training role.

Modes: `serving` (decoding), `paused` (by `pause_all`: every request and its KV kept),
`broken` (a version failed half-way: nothing decodes until a complete version loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cells.engine.records import EngineError
from cells.engine.sglang.runtime import SGLangRuntime

NO_VERSION = -1
"""`version` while no complete version is loaded (weights released without a CPU backup, or
an update that failed half-way): below every real version, so whatever version arrives is
installed. `summary()` reports it as None."""


@dataclass
class Serving:
    runtime: SGLangRuntime
    version: int
    """The last complete version loaded (valid only with `weights_valid`)."""
    weights_valid: bool = True
    mode: str = "serving"
    released: set[str] = field(default_factory=set)
    """GPU memory tags handed to the training role."""
    deferred: tuple[int, dict[str, torch.Tensor]] | None = None
    """A version that arrived while the weights' memory was released (memory.py)."""

    @property
    def served(self) -> int:
        """The version served, or to be served once back in rollout; `NO_VERSION` if none."""
        if self.deferred is not None:
            return self.deferred[0]
        return self.version if self.weights_valid else NO_VERSION

    def pause_all(self) -> None:
        """Freeze decoding of every request, keeping them and their KV (SGLang `in_place`)."""
        if self.mode == "broken":
            raise EngineError("cell is broken; nothing decodes")
        if self.mode == "serving":
            self.runtime.pause("in_place")
            self.mode = "paused"

    def resume_all(self) -> None:
        """Continue decoding after `pause_all`."""
        if self.mode == "paused":
            self.runtime.continue_generation()
            self.mode = "serving"

"""The RL learning-rate schedule: a linear warm-up, then constant or a decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """A linear warm-up over the first `warmup_steps` optimizer steps of RL, then `kind`:
    `constant`, or a `cosine` / `linear` decay that reaches `min_ratio` of the rate at
    `total_steps` RL optimizer steps (then held there; without `total_steps`: constant)."""

    warmup_steps: int = 0
    kind: str = "constant"
    total_steps: int | None = None
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.kind!r}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"lr_min_ratio must be in [0, 1], got {self.min_ratio}")

    def scale(self, k: int) -> float:
        """The factor of RL's optimizer step number `k` (from 1)."""
        if self.warmup_steps > 0 and k <= self.warmup_steps:
            return k / self.warmup_steps
        if self.kind == "constant" or not self.total_steps:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        p = min(1.0, (k - self.warmup_steps) / span)
        decay = 0.5 * (1.0 + math.cos(math.pi * p)) if self.kind == "cosine" else 1.0 - p
        return self.min_ratio + (1.0 - self.min_ratio) * decay

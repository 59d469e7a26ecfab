"""The scheduler's clock of leases and deadlines when it serves on a live event loop: monotonic
time minus the time the loop itself could not run.

A lease measures a cell's silence, not the scheduler's: while one request holds the event loop
(a body being parsed, a turn being rendered), no heartbeat is served, and a plain monotonic
clock would fence every cell whose sync waited behind it. A beat task records when the loop
last ran; a gap past `grace_s` is a stall, and the clock does not advance through it (nor
through one still in progress when the first handler after it asks the time). Tests that move
a fake clock by hand run no loop and use that clock as is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

BEAT_S = 0.1
"""How often the beat task records that the loop runs."""


class StallClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic, grace_s: float = 1.0,
                 on_lag: Callable[[float], None] | None = None) -> None:
        self.base = clock
        self.grace_s = grace_s
        self.on_lag = on_lag
        """Called with each beat's lateness (seconds past BEAT_S): how long the loop was held."""
        self.last = clock()
        self.stalled = 0.0
        """Seconds of loop stalls so far, left out of this clock."""

    def beat(self) -> None:
        now = self.base()
        gap = now - self.last
        if gap > self.grace_s:
            self.stalled += gap - self.grace_s
        self.last = now
        if self.on_lag is not None:
            self.on_lag(max(0.0, gap - BEAT_S))

    def __call__(self) -> float:
        now = self.base()
        return now - self.stalled - max(0.0, now - self.last - self.grace_s)

    async def run(self) -> None:
        """The beat task (until cancelled)."""
        while True:
            self.beat()
            await asyncio.sleep(BEAT_S)

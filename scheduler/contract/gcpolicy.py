"""A process's garbage collection, paced by its own loop: the scheduler's control loop, and a
cell's sync loop (where a full collection of the engine's objects held every thread ~140 ms:
the one long gap of a decoding stream).

At 10,000 cells the scheduler holds ~140,000 long-lived tracked objects (per-cell rows,
summaries, leases). CPython's automatic oldest-generation collection walks all of them: ~80 ms
with the event loop held, at moments the allocator picks, every few seconds under load; every
REST request and tick waiting behind it feels that pause. The fleet's state is acyclic
(refcounting frees it), so the loop moves what is alive into the permanent generation
(`gc.freeze`) every `freeze_every_s`: the automatic collections then walk only what was made
since. Every `full_every_s` it unfreezes and runs one full collection (the only pause of that
size, on a known schedule: the `cellflip_gc_full_seconds` histogram), so a cycle made in
between is reclaimed within that interval. A cell runs it when idle (no request in flight),
deferring it at most `max_defer_s` past due. Only a scheduler that owns its process does this
(`python -m scheduler`, a server started by module path); one sharing a process with other work
(`cellflip up`'s launcher, `$CELLFLIP_SCHEDULER_SHARES_PROCESS`) leaves the collector alone.

The scheduler also raises the youngest generation's threshold (`young_threshold`, from the first
step on): a tick at 10,000 cells with every cell changed makes ~30,000 lasting objects beside a
handful of fleet-sized temporary sets and dicts (the cells that changed, the rows re-read). At
CPython's 700 that was ~40 young collections a tick, each walking every one of those young
fleet-sized containers again: ~25-45 ms of a ~200 ms tick. At `SCHEDULER_YOUNG_THRESHOLD` a tick
runs about one young collection, which walks each object once.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

FREEZE_EVERY_S = 1.0
"""Under load a tick replaces thousands of per-cell objects: a longer period lets the young
set grow back toward the whole fleet before the next freeze."""
FULL_EVERY_S = 600.0
SCHEDULER_YOUNG_THRESHOLD = 50_000
"""Allocations between two young collections in the scheduler (CPython's default: 700)."""


class GcPolicy:
    def __init__(self, clock: Callable[[], float], observe: Callable[[float], None] | None = None,
                 freeze_every_s: float = FREEZE_EVERY_S, full_every_s: float = FULL_EVERY_S,
                 max_defer_s: float = 0.0, young_threshold: int | None = None) -> None:
        self.clock, self.observe = clock, observe
        self.young_threshold = young_threshold
        """Kept as the youngest generation's threshold from the first step on (None: left as it is)."""
        self.freeze_every_s, self.full_every_s = freeze_every_s, full_every_s
        self.max_defer_s = max_defer_s
        self.last_freeze = float("-inf")
        self.last_full: float | None = None
        """None: no step yet (the first full collection is one interval after the first step)."""

    def step(self, idle: bool = True) -> None:
        """Between ticks: freeze what is alive, or run the scheduled full collection (when
        `idle`, or once it is `max_defer_s` overdue)."""
        now = self.clock()
        if self.last_full is None:
            self.last_full = now
        if self.young_threshold is not None and gc.get_threshold()[0] != self.young_threshold:
            gc.set_threshold(self.young_threshold, *gc.get_threshold()[1:])
        due = now - self.last_full - self.full_every_s
        if due >= 0 and (idle or due >= self.max_defer_s):
            t0 = time.perf_counter()
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            if self.observe is not None:
                self.observe(time.perf_counter() - t0)
            self.last_full = self.last_freeze = now
        elif now - self.last_freeze >= self.freeze_every_s:
            gc.freeze()
            self.last_freeze = now


def log_long_pauses(log: logging.Logger, threshold_s: float = 0.05) -> None:
    """Log every collection that held the process longer than `threshold_s` (every thread
    waits on it: decoding, the sync loop, a migration's sends). Once per process."""
    if any(getattr(cb, "logs_long_pauses", False) for cb in gc.callbacks):
        return
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and (took := time.perf_counter() - started[0]) > threshold_s:
            log.warning("garbage collection (generation %d) held the process %.0f ms", info.get("generation", -1),
                        took * 1e3)

    on_gc.logs_long_pauses = True  # type: ignore[attr-defined]
    gc.callbacks.append(on_gc)

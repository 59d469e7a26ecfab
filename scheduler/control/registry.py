"""Live (volatile) view of the cells: leases, last summaries and command queues.

Nothing here is durable: after a restart every entry is rebuilt from the store, with a fresh
lease of `lease_s` (the inventory grace), and then from the cells' own syncs. Leases run on
the scheduler's monotonic clock only (`clock`), never on wall time or a cell's clock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.contract.protocol import Command, Summary
from scheduler.control.notify import Notifier

SWEEP_CELLS_PER_TICK = 1000
"""Live cells a level-triggered sweep visits per tick: a small fleet is visited whole every
tick; 10,000 cells once every 10 ticks (2 s at the default period), so one tick holds the
event loop for a bounded time whatever the fleet's size."""


@dataclass(slots=True)
class LiveCell:
    cell_id: str
    lease_deadline: float
    summary: Summary | None = None
    summary_at: float = float("-inf")
    seen: bool = False
    """Registered or synced since this scheduler process started."""
    commands: deque = field(default_factory=deque)


class Registry:
    def __init__(self, clock: Callable[[], float], notifier: Notifier) -> None:
        self.clock = clock
        self.notifier = notifier
        self.live: dict[str, LiveCell] = {}
        self._sinks: list[set[str]] = []
        self._deadlines: list[tuple[float, str]] = []
        """Heap of (lease deadline, cell): at most one live entry per cell (`_queued`), never
        later than the cell's deadline."""
        self._queued: dict[str, float] = {}
        """cell → the deadline of its live entry in `_deadlines`."""
        self._late: set[str] = set()
        """Cells found past their deadline and still live (reported by every `expired` call)."""
        self._ids: list[str] | None = None
        """The live ids in id order (None: to rebuild after an admit or drop)."""
        # command ids keep growing across scheduler restarts (a cell may dedupe on them)
        self._cmd_ids = itertools.count(int(time.time() * 1000) * 1000)

    def watch(self) -> set[str]:
        """A set that from now on collects the cells whose entry changed what a reader of the
        registry keeps (admitted, dropped, first seen, or a summary with other KV blocks, version
        or versions held); the reader empties it when it has taken them."""
        sink: set[str] = set()
        self._sinks.append(sink)
        return sink

    def mark(self, cell_id: str) -> None:
        for sink in self._sinks:
            sink.add(cell_id)

    def rotation(self, per_tick: int = SWEEP_CELLS_PER_TICK) -> Rotation:
        """A round-robin cursor over the live cells, for a level-triggered sweep."""
        return Rotation(self, per_tick)

    def ids(self) -> list[str]:
        """The live cells' ids in id order (kept between admits and drops; do not change it)."""
        if self._ids is None:
            self._ids = sorted(self.live)
        return self._ids

    def admit(self, cell_id: str, lease_s: float, seen: bool) -> LiveCell:
        """(Re)create the live entry with a fresh lease; drops any queued commands."""
        if cell_id not in self.live:
            self._ids = None
        entry = LiveCell(cell_id, self.clock() + lease_s, seen=seen)
        self.live[cell_id] = entry
        self._late.discard(cell_id)
        self._queue(cell_id, entry.lease_deadline)
        self.mark(cell_id)
        self.notifier.notify(("cell", cell_id))
        return entry

    def drop(self, cell_id: str) -> None:
        if self.live.pop(cell_id, None) is not None:
            self._ids = None
        self.mark(cell_id)
        self.notifier.notify(("cell", cell_id))

    def summary(self, cell_id: str) -> Summary | None:
        """The cell's last reported summary (None: not live, or not synced since admitted)."""
        entry = self.live.get(cell_id)
        return None if entry is None else entry.summary

    def renew(self, cell_id: str, lease_s: float, summary: Summary) -> None:
        entry = self.live[cell_id]
        old = entry.summary
        if (not entry.seen or old is None or old.kv_blocks_used != summary.kv_blocks_used
                or old.kv_blocks_total != summary.kv_blocks_total or old.version != summary.version
                or old.versions_held != summary.versions_held):
            self.mark(cell_id)
        now = self.clock()
        self.extend(cell_id, lease_s)
        entry.summary, entry.summary_at, entry.seen = summary, now, True

    def extend(self, cell_id: str, lease_s: float) -> None:
        """A fresh lease of `lease_s` from now for a live cell. The heap keeps the earliest
        deadline queued for the cell; a later one is queued when that pops (`expired`), so a
        sync pushes nothing while its cell's entry stands."""
        entry = self.live[cell_id]
        entry.lease_deadline = self.clock() + lease_s
        self._late.discard(cell_id)
        self._queue(cell_id, entry.lease_deadline)

    def _queue(self, cell_id: str, deadline: float) -> None:
        if self._queued.get(cell_id, float("inf")) > deadline:
            self._queued[cell_id] = deadline
            heapq.heappush(self._deadlines, (deadline, cell_id))

    def is_expired(self, cell_id: str) -> bool:
        entry = self.live.get(cell_id)
        return entry is None or self.clock() > entry.lease_deadline

    def expired(self) -> list[str]:
        """Live cells past their lease deadline, in id order. Pops only the deadlines that
        passed (a heap), so a tick does not walk every lease."""
        now, heap = self.clock(), self._deadlines
        while heap and heap[0][0] < now:
            deadline, cid = heapq.heappop(heap)
            if self._queued.get(cid) != deadline:
                continue  # stale: an earlier deadline was queued for it since
            del self._queued[cid]
            entry = self.live.get(cid)
            if entry is None:
                continue
            if entry.lease_deadline <= deadline:
                self._late.add(cid)
            else:  # renewed since: queue its current deadline
                self._queue(cid, entry.lease_deadline)
        self._late = {cid for cid in self._late if cid in self.live and now > self.live[cid].lease_deadline}
        return sorted(self._late)

    def send(self, cell_id: str, make: Callable[[int], Command]) -> Command | None:
        """Queue `make(cmd_id)` for a live cell and wake its long-poll; None if it is not live."""
        entry = self.live.get(cell_id)
        if entry is None:
            return None
        cmd = make(next(self._cmd_ids))
        entry.commands.append(cmd)
        self.notifier.notify(("cell", cell_id))
        return cmd

    def take(self, cell_id: str) -> list[Command]:
        entry = self.live.get(cell_id)
        if entry is None:
            return []
        out = list(entry.commands)
        entry.commands.clear()
        return out

    def has_commands(self, cell_id: str) -> bool:
        entry = self.live.get(cell_id)
        return bool(entry and entry.commands)


class Rotation:
    """Hands a sweep the next `per_tick` live cells in id order, wrapping around: every live
    cell is visited once per ceil(live / per_tick) calls (all of them each call in a small fleet)."""

    def __init__(self, registry: Registry, per_tick: int) -> None:
        self.registry, self.per_tick = registry, per_tick
        self.after = ""
        """The last id visited ("" : start from the first)."""

    def next(self) -> list[str]:
        ids = self.registry.ids()
        if len(ids) <= self.per_tick:
            return list(ids)
        k = bisect.bisect_right(ids, self.after)
        out = ids[k: k + self.per_tick]
        if len(out) < self.per_tick:
            out += ids[: self.per_tick - len(out)]
        self.after = out[-1]
        return out

"""Live (volatile) view of the cells: leases, last summaries and command queues.

Nothing here is durable: after a restart every entry is rebuilt from the store, with a fresh
lease of `lease_s` (the inventory grace), and then from the cells' own syncs. Leases run on
the scheduler's monotonic clock only (`clock`), never on wall time or a cell's clock.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.contract.protocol import Command, Summary
from scheduler.control.notify import Notifier


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
        self.changed: set[str] = set()
        """Cells whose entry changed what the planner's snapshot reads from it (admitted,
        dropped, first seen, or a summary with other KV blocks or version) since the snapshot
        last took them."""
        # command ids keep growing across scheduler restarts (a cell may dedupe on them)
        self._cmd_ids = itertools.count(int(time.time() * 1000) * 1000)

    def admit(self, cell_id: str, lease_s: float, seen: bool) -> LiveCell:
        """(Re)create the live entry with a fresh lease; drops any queued commands."""
        entry = LiveCell(cell_id, self.clock() + lease_s, seen=seen)
        self.live[cell_id] = entry
        self.changed.add(cell_id)
        self.notifier.notify(("cell", cell_id))
        return entry

    def drop(self, cell_id: str) -> None:
        self.live.pop(cell_id, None)
        self.changed.add(cell_id)
        self.notifier.notify(("cell", cell_id))

    def summary(self, cell_id: str) -> Summary | None:
        """The cell's last reported summary (None: not live, or not synced since admitted)."""
        entry = self.live.get(cell_id)
        return None if entry is None else entry.summary

    def renew(self, cell_id: str, lease_s: float, summary: Summary) -> None:
        entry = self.live[cell_id]
        old = entry.summary
        if (not entry.seen or old is None or old.kv_blocks_used != summary.kv_blocks_used
                or old.kv_blocks_total != summary.kv_blocks_total or old.version != summary.version):
            self.changed.add(cell_id)
        now = self.clock()
        entry.lease_deadline = now + lease_s
        entry.summary, entry.summary_at, entry.seen = summary, now, True

    def is_expired(self, cell_id: str) -> bool:
        entry = self.live.get(cell_id)
        return entry is None or self.clock() > entry.lease_deadline

    def expired(self) -> list[str]:
        now = self.clock()
        return [cid for cid, e in self.live.items() if now > e.lease_deadline]

    def send(self, cell_id: str, make: Callable[[int], Command]) -> Command | None:
        """Queue `make(cmd_id)` for a live cell and wake its long-poll; None if it is not live."""
        entry = self.live.get(cell_id)
        if entry is None:
            return None
        cmd = make(next(self._cmd_ids))
        entry.commands.append(cmd)
        self.notifier.notify(("cell", cell_id))
        return cmd

    def take(self, cell_id: str) -> list[dict]:
        entry = self.live.get(cell_id)
        if entry is None:
            return []
        out = [c.to_dict() for c in entry.commands]
        entry.commands.clear()
        return out

    def has_commands(self, cell_id: str) -> bool:
        entry = self.live.get(cell_id)
        return bool(entry and entry.commands)

"""What every concern of the control plane shares: the store and its transactions (whose
effects on cells and waiters run only after the commit), the live registry of cells, the
scheduler's monotonic clock, the configs and the metrics.

Each concern (scheduler/control/ownership.py, migrations.py, flips.py, versions.py, scoring.py, ...)
holds one `Context` beside its own state; the controller builds the context and composes the
concerns. Nothing here decides anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.control.durability import DurableTail
from scheduler.control.notify import Notifier
from scheduler.control.registry import Registry

if TYPE_CHECKING:
    from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig, VersionsConfig
    from scheduler.contract.protocol import Command
    from scheduler.control.metrics import Metrics
    from scheduler.store import Store

TICK_KEY = ("tick",)
"""The notifier key the control loop waits on between ticks."""


@dataclass
class Effects:
    """What a transaction does to the outside world, run only after it committed."""

    registry: Registry
    notifier: Notifier
    _todo: list[Callable[[], object]] = field(default_factory=list)

    def send(self, cell_id: str, make: Callable[[int], Command]) -> None:
        self._todo.append(lambda: self.registry.send(cell_id, make))

    def notify(self, key: Hashable) -> None:
        self._todo.append(lambda: self.notifier.notify(key))

    def notify_many(self, keys: list[Hashable]) -> None:
        """`notify` each of `keys` (one deferred call for all)."""
        notify = self.notifier.notify
        self._todo.append(lambda: [notify(k) for k in keys])

    def later(self, fn: Callable[[], object]) -> None:
        self._todo.append(fn)

    def join(self, part: Effects) -> None:
        """Take on `part`'s effects (a part of this transaction that held: groupcommit.py)."""
        self._todo += part._todo
        part._todo = []

    def run(self) -> None:
        for fn in self._todo:
            fn()
        self._todo.clear()


class Context:
    """The shared plumbing; mutated only by `txn`, `kick` and `close`."""

    def __init__(self, store: Store, cfg: SchedulerConfig, mig_cfg: MigrationConfig, ver_cfg: VersionsConfig,
                 metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.cfg = cfg
        self.mig_cfg = mig_cfg
        self.ver_cfg = ver_cfg
        self.metrics = metrics
        self.clock = clock
        self.notifier = Notifier()
        self.registry = Registry(clock, self.notifier)
        self.started_at = clock()
        self.closing = False
        """Set at shutdown: waiting client streams end (their tokens stay in the store)."""
        self.placeable: Callable[[str | None, str | None], Container[str] | None] = _anywhere
        """(session, cell) → the cells a request of that session, or leaving that cell, may be
        placed on: its RL job's cells (scheduler/control/jobs.py); None: any cell (one job)."""
        self.tail = DurableTail(store)
        """Effects of commits that wait for the disk (scheduler/control/durability.py)."""
        self._fx: Effects | None = None
        self._fx_deferred = False
        """The open transaction's durable commit skips its sync (its effects wait for the tail's)."""

    @contextmanager
    def txn(self, durable: bool = True) -> Iterator[Effects]:
        """A store transaction whose Effects run after it is durably committed (nested calls join
        it). In the running loop's tick (`tail.deferring`) a durable commit skips its own sync and
        its effects wait for the tail's, off the loop's thread; effects always run in commit order."""
        if self._fx is not None:
            with self.store.tx(durable and not self._fx_deferred):
                yield self._fx
            return
        deferred = durable and self.tail.deferring
        fx = self._fx = Effects(self.registry, self.notifier)
        self._fx_deferred = deferred
        try:
            with self.store.tx(durable and not deferred):
                yield fx
        finally:
            self._fx, self._fx_deferred = None, False
        self.tail.committed(fx, durable, deferred)

    def kick(self) -> None:
        """Ask the loop for a tick soon (a flip was requested, a request is waiting)."""
        self.notifier.notify(TICK_KEY)

    def close(self) -> None:
        """Release every long-poll and client stream so shutdown does not wait on them."""
        self.closing = True
        self.notifier.notify_all()


def _anywhere(session_id: str | None, cell_id: str | None) -> Container[str] | None:
    return None

"""The loop's commits made durable off its thread: effects wait for the disk, the loop does not.

A durable transaction used to end in an fsync of the WAL on the event loop's thread, and the
tick's commits paid for every page written since the last one — the token syncs' too, which
commit without a sync of their own (groupcommit.py). Under a fleet's write load that was half of
a busy tick (~25 ms of 50 on a virtual disk) during which no request was served.

While the running loop ticks (`deferring`), a durable transaction commits without the sync
(synchronous=NORMAL: atomic, ordered, not yet durable) and its `Effects` — the commands to
cells, the wake-ups — are held here instead of run. At the tick's end `sync_soon` has a worker
thread fsync the WAL file (what synchronous=FULL does at each commit, once for all of them);
once it returns, every effect held before it began runs on the loop's thread, in commit order.
So nothing outside the store — no cell, no waiting client — hears of a change before it is on
disk: a cell is told to start a request only once its ownership (owner, epoch) is durable, as
before; a crash before the sync loses the commits and, with them, every effect that would have
told anyone.

The WAL's checkpoints (copying its frames into the database file) leave the loop's thread too:
once the running loop syncs here, the store's automatic checkpoints — run inline by whichever
commit crossed 4,000 frames, ~30 ms under a fleet's writes — are off, and the worker runs a
passive one at most every `CHECKPOINT_EVERY_S` after a tick (`Store.take_over_checkpoints`).

Order is kept with the commits made meanwhile by others (REST handlers, token syncs): while
effects are held, a later transaction's effects queue behind them; a later durable commit (its
own fsync covers every earlier commit) releases all of them first. `settle` syncs and releases
at once (shutdown, and callers without an event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.store import Store
    from scheduler.store.db import Checkpointer

log = logging.getLogger("cellflip.scheduler")

CHECKPOINT_EVERY_S = 1.0
"""A passive checkpoint of the WAL at most this often, on the worker, once it runs them."""


class Effects(Protocol):
    """A committed transaction's effects (`context.Effects`), run once."""

    def run(self) -> None: ...


class DurableTail:
    """Effects of commits not yet synced, in commit order. Owns the worker thread and, once the
    running loop has synced through it, the store's checkpoints."""

    def __init__(self, store: Store) -> None:
        self.store = store
        db_path = store.path
        self.wal = None if db_path == ":memory:" else f"{db_path}-wal"
        self.deferring = False
        """A durable commit now skips its own sync and holds its effects (the loop's tick)."""
        self.held: deque[tuple[int, Effects]] = deque()
        """(sequence number, effects) of commits whose effects wait, oldest first."""
        self.seq = 0
        self._pool: ThreadPoolExecutor | None = None
        self._sync: tuple[int, Future] | None = None
        """(the newest sequence number it covers, the sync under way)."""
        self._checkpoint: Checkpointer | None = None
        """Set once this runs the store's checkpoints (the store's own are off then)."""
        self._last_checkpoint = float("-inf")

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Durable commits made inside skip their own sync (no-op without a WAL file)."""
        if self.wal is None or self.deferring:
            yield
            return
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def committed(self, fx: Effects, durable: bool, deferred: bool) -> None:
        """A transaction committed: run its effects now, or hold them behind those that wait."""
        if deferred:
            self._hold(fx)
        elif not self.held:
            fx.run()
        elif durable:  # its own sync covered every commit before it
            self._release(self.seq)
            fx.run()
        else:  # not durable itself, but ordered after effects that wait for the disk
            self._hold(fx)

    def _hold(self, fx: Effects) -> None:
        self.seq += 1
        self.held.append((self.seq, fx))

    def sync_soon(self) -> None:
        """After a tick: have the worker fsync the WAL for what is held — its effects run once
        that returns (on the running event loop's thread; without one, at the next `settle`) —
        and, when due, checkpoint the WAL after it."""
        if self.wal is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cellflip-wal-sync")
        if self.held and self._sync is None:
            self._start_sync(self._pool)
        now = time.monotonic()
        if now - self._last_checkpoint >= CHECKPOINT_EVERY_S:  # after the sync: the effects wait for it only
            self._last_checkpoint = now
            if self._checkpoint is None:
                self._checkpoint = self.store.take_over_checkpoints()
            self._pool.submit(self._checkpoint_once)

    def _start_sync(self, pool: ThreadPoolExecutor) -> None:
        upto = self.seq
        fut = pool.submit(self._fsync)
        self._sync = (upto, fut)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # `settle` takes it
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._done, upto, f))

    def settle(self) -> None:
        """Sync now and run every held effect (waits for a sync under way first)."""
        if self._sync is not None:
            upto, fut = self._sync
            fut.exception()  # waits; `_done` logs it
            self._done(upto, fut)
        if self.held:
            self._fsync()
            self._release(self.seq)

    def close(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._checkpoint is not None:
            self._checkpoint.close()

    def _checkpoint_once(self) -> None:
        try:
            self._checkpoint()
        except Exception:  # the next one copies what this did not; the WAL only grows meanwhile
            log.exception("checkpointing the store's WAL failed")

    def _done(self, upto: int, fut: Future) -> None:
        if self._sync is None or self._sync[1] is not fut:
            return  # `settle` took it already
        self._sync = None
        err = fut.exception()
        if err is not None:  # nothing is released: the next sync covers these too
            log.error("syncing the store's WAL failed (%s): its commits' effects wait for the next sync", err)
            return
        self._release(upto)
        if self.held:  # committed while the sync ran: a sync of their own
            self.sync_soon()

    def _release(self, upto: int) -> None:
        while self.held and self.held[0][0] <= upto:
            _, fx = self.held.popleft()
            try:
                fx.run()
            except Exception:  # one commit's effect must not keep the others from running
                log.exception("running a commit's effects failed")

    def _fsync(self) -> None:
        if self.wal is None:
            return
        try:
            fd = os.open(self.wal, os.O_RDONLY)
        except FileNotFoundError:  # no WAL: every commit is in the database file, synced
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

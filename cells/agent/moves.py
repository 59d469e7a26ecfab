"""The cell's migration threads: one per `migrate_out` / `migrate_in`, cancelled by
`cancel_migration`, their outcomes folded into the agent's ownership between two steps.

Every engine operation of a migration runs under the agent's engine lock through `on_kv`, on
the engine as a `KVHandover` (only an engine with `capabilities.kv_export` is sent these
commands; another one fails the move, which the scheduler then aborts).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from cells.agent.host import MovesHost
from cells.agent.owned import Owned
from cells.engine.base import KVHandover, kv_handover
from cells.migration import (
    CHUNK_BYTES,
    MigrationReceiver,
    MigrationSender,
    Outcome,
    StagingBuffers,
    migration_event,
)
from scheduler.contract.protocol import CancelMigrationCmd, MigrateInCmd, MigrateOutCmd

log = logging.getLogger("cellflip.cell")


class Moves:
    """Migration threads of one agent, by migration id."""

    def __init__(self, agent: MovesHost, *, on_host: bool) -> None:
        self.agent = agent
        # one copy round's worth of warm receive buffer (no bigger than the KV pool itself)
        pool_bytes = kv_handover(agent.engine).kv_pool_nbytes() if on_host else 0
        self.staging = StagingBuffers(prealloc_numel=min(CHUNK_BYTES, pool_bytes) // 4)
        self._outcomes: queue.Queue[Outcome] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._running: dict[str, MigrationSender | MigrationReceiver] = {}
        """Migrations in flight here, by id (for `cancel`)."""

    def busy(self) -> bool:
        return bool(self._threads)

    def thread_names(self) -> list[str]:
        return [t.name for t in list(self._threads) if t.is_alive()]

    # -- commands (sync loop, under the engine lock) ----------------------------------------
    def migrate_out(self, cmd: MigrateOutCmd) -> None:
        a, rid = self.agent, cmd.request_id
        if rid not in a.owned or rid not in a.engine.requests:
            return
        sender = MigrationSender(cmd, cell_id=a.cell_id, incarnation=a.incarnation, store=a.store_host.store,
                                 client=a.client, cfg=a.cfg.migration, on_engine=self.on_kv,
                                 flushed=lambda: self._stop_flush(rid),
                                 synced=None if a.owned[rid].parked else (lambda: self._synced(rid)),  # parked: no stream
                                 quiesce=a.quiesce, peek=lambda fn: fn(kv_handover(a.engine)))
        self._spawn(sender, f"mig-out-{rid}")

    def migrate_in(self, cmd: MigrateInCmd) -> None:
        a, rid = self.agent, cmd.request_id
        receiver = MigrationReceiver(cmd, cell_id=a.cell_id, incarnation=a.incarnation, client=a.client,
                                     cfg=a.cfg.migration, on_engine=self.on_kv, on_commit=self._adopt,
                                     quiesce=a.quiesce, staging=self.staging)
        self._spawn(receiver, f"mig-in-{rid}", on_crash=lambda: self._settle_crashed_import(rid))

    def cancel(self, cmd: CancelMigrationCmd) -> None:
        """The scheduler aborted the migration. A thread still moving it stops at its next
        step (the source resumes the request and keeps it, the destination frees its
        reservation and never commits). With no thread left, undo what is left of it here:
        a source that kept the request paused (its abort never reached the scheduler)
        resumes it; a destination frees whatever it still holds for it."""
        mig = self._running.get(cmd.migration_id)
        if mig is not None:
            log.info("migration %s of %s cancelled by the scheduler", cmd.migration_id, cmd.request_id)
            mig.cancel()
            return
        a, rid = self.agent, cmd.request_id
        if not a.engine.capabilities.kv_export or any(m.cmd.request_id == rid for m in list(self._running.values())):
            return  # nothing of it here, or a newer move of the request is under way
        kv = kv_handover(a.engine)
        o = a.owned.get(rid)
        if o is not None:
            if not o.migrating and kv.is_paused(rid):
                kv.unpause(rid)
                log.info("resumed %s: its migration %s was cancelled", rid, cmd.migration_id)
        else:
            kv.release(rid)

    # -- engine access (migration threads) --------------------------------------------------
    def on_kv(self, fn: Callable[[KVHandover], Any]) -> Any:
        """Run `fn(engine)` from a migration thread between engine steps; returns its result."""
        a = self.agent
        with a.access():
            out = fn(kv_handover(a.engine))
        a.wake()
        return out

    def _synced(self, rid: str) -> int:
        """Generated tokens of `rid` already in the store (visible to its client)."""
        o = self.agent.owned.get(rid)
        return o.flushed if o is not None else 0

    def _stop_flush(self, rid: str) -> int:
        """Called on the loop thread at the stop-and-copy: no more token batches for `rid`
        from here (its unsynced records travel in the commit's tail)."""
        o = self.agent.owned[rid]
        o.migrating = True
        return o.flushed

    def _adopt(self, rid: str, epoch: int, num_generated: int) -> None:
        """The destination's commit won: own the request from here (called under the lock)."""
        self.agent.owned[rid] = Owned(epoch, num_generated)

    # -- threads ----------------------------------------------------------------------------
    def _spawn(self, mig: MigrationSender | MigrationReceiver, name: str,
               on_crash: Callable[[], None] | None = None) -> None:
        mid = mig.cmd.migration_id
        self._running[mid] = mig

        def body():
            try:
                self._outcomes.put(mig.run())
            except Exception:  # a bug or an injected fault: never leave the request hanging
                log.exception("%s crashed", name)
                if on_crash is not None:
                    on_crash()
            finally:
                self._running.pop(mid, None)
            self.agent.wake()

        t = threading.Thread(target=body, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _settle_crashed_import(self, rid: str) -> None:
        """The destination's migration thread died. After its commit the request is ours
        (adopted): resume it. Before: free the reservation; the source keeps the request
        (its abort wins at the scheduler)."""
        a = self.agent
        with a.access():
            kv = kv_handover(a.engine)
            if rid in a.owned:
                if kv.is_paused(rid):
                    kv.resume_request(rid)
                    log.warning("resumed %s after its import thread crashed past the commit", rid)
            else:
                kv.release(rid)

    def reap(self) -> None:
        """Engine loop, under the lock: fold finished migrations into ownership and events."""
        a = self.agent
        self._threads = [t for t in self._threads if t.is_alive()]
        while True:
            try:
                o = self._outcomes.get_nowait()
            except queue.Empty:
                return
            if o.role == "source":
                if o.result == "committed":
                    a.owned.pop(o.request_id, None)
                    a.held.ended(o.request_id)
                elif o.request_id in a.owned:
                    a.owned[o.request_id].migrating = False
            if o.role == "destination" or o.result != "committed":
                a.events.append(migration_event(o))
            log_path = os.environ.get("CELLFLIP_MIGRATION_LOG")
            if log_path:  # per-migration records for benchmarks and post-mortems
                with open(log_path, "a") as f:
                    f.write(json.dumps({"cell": a.cell_id, **o.__dict__}) + "\n")

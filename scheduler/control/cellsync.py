"""Cell membership: register, sync (heartbeat + tokens + events ⇄ commands), fence.

One line per sync: check incarnation and lease → renew the lease → commit tokens, in one
transaction with the syncs that arrived beside it (groupcommit.py; then wake client streams) → apply ownership outcomes and events durably → long-poll for commands.

Fencing is the only way a cell incarnation leaves: a lost lease or a new incarnation under the
same id marks it `down` (generation + 1), then asks each concern in turn what the cell held
(`on_cell_fenced`): migrations abort its pending moves, ownership re-places its requests at
epoch + 1, flips fail its flip, scoring forgets its tasks, versions forget what it was told to
load. Nothing it sends later is accepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.contract.errors import Conflict, NotFound
from scheduler.contract.failpoints import CANARY_NO_FENCING
from scheduler.contract.protocol import (
    MAX_WAIT_S,
    RegisterRequest,
    RegisterResponse,
    SyncRequest,
    SyncResponse,
)
from scheduler.contract.states import CELL, set_state
from scheduler.control import jobmodels
from scheduler.control.groupcommit import GroupCommit
from scheduler.store.fleet import CellRow, SyncView

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.ingest import Ingest
    from scheduler.control.trust import Trust
    from scheduler.control.versions import Versions


class CellHolder(Protocol):
    """A concern that holds something of a cell and lets go of it when the cell is fenced."""

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None: ...


class Membership:
    """Register, sync and fence: the cell side of the control plane. Holds no state beyond the
    context's registry of live cells."""

    def __init__(self, ctx: Context, versions: Versions, ingest: Ingest, trust: Trust,
                 holders: Sequence[CellHolder]) -> None:
        self.ctx = ctx
        self.versions = versions
        self.ingest = ingest
        self.trust = trust
        self.holders = tuple(holders)
        """Asked in this order when a cell is fenced."""
        self.job_assigned: Callable[[], None] = lambda: None
        """Told when a registration put a cell under a chosen RL job (the jobs' membership view)."""
        self.group = GroupCommit(ctx, ingest.accept_tokens)
        """Token batches of the syncs that arrive together, committed in one transaction."""

    def recover(self) -> None:
        """After a start: every cell the store has not down gets a lease of `lease_s` (the
        grace) and must sync or re-register within it."""
        for cell in self.ctx.store.fleet.list_cells():
            if cell.state != "down":
                self.ctx.registry.admit(cell.id, self.ctx.cfg.lease_s, seen=False)

    # ------------------------------------------------------------------ register
    def register(self, msg: RegisterRequest, admin: bool = False) -> RegisterResponse:
        """Join (or re-join after a scheduler restart) the fleet. A new incarnation of a known id
        fences the old one only once the old one's lease has lapsed (or it is down), unless an
        admin registers it: a live cell's id cannot be taken over (409 `cell_id_in_use`). The
        registration probe sets the cell's trust (scheduler/control/trust.py)."""
        ctx = self.ctx
        known = ctx.store.fleet.get_cell(msg.cell_id)
        if known is not None and known.trust == "quarantined" and not admin:
            raise Conflict(f"{msg.cell_id} is quarantined: an admin readmits it (POST /v1/cells/{msg.cell_id}/readmit)",
                           code="quarantined")
        if (known is not None and known.incarnation != msg.incarnation and known.state != "down" and not admin
                and known.id in ctx.registry.live and not ctx.registry.is_expired(known.id)):
            raise Conflict(f"{msg.cell_id} is live under another incarnation: register again once its lease "
                           f"({ctx.cfg.lease_s:g}s) lapses", code="cell_id_in_use", retry_after_s=ctx.cfg.lease_s)
        if (known is not None and known.incarnation == msg.incarnation and known.state != "down"
                and ctx.registry.is_expired(msg.cell_id)):  # its lease ran out: same rule as a sync
            self.fence(msg.cell_id, "lease expired")
            raise Conflict(f"lease of {msg.cell_id} expired", code="fenced")
        job = jobmodels.registration_job(ctx.store, msg.cell_id, msg.job, msg.model)  # refused: nothing recorded
        with ctx.txn(durable=True) as fx:
            row = self._registered_row(fx, msg)
            self.trust.admit(fx, row, msg, admin)
            ctx.store.fleet.put_cell(row)
            jobmodels.record_registration(ctx.store, msg.cell_id, job, msg.model)
        if job is not None:
            self.job_assigned()
        if row.state == "joining":  # a new process: what the old one was told to load does not carry over
            self.versions.forget_cell(msg.cell_id)
        entry = ctx.registry.live.get(msg.cell_id)
        if entry is not None and row.state != "joining":
            ctx.registry.extend(msg.cell_id, ctx.cfg.lease_s)
            entry.seen = True
            ctx.registry.mark(msg.cell_id)
        else:
            ctx.registry.admit(msg.cell_id, ctx.cfg.lease_s, seen=True)
        ctx.kick()
        return RegisterResponse(row.generation, ctx.cfg.lease_s, ctx.cfg.heartbeat_s)

    def _registered_row(self, fx: Effects, msg: RegisterRequest) -> CellRow:
        """The cell's row after this registration (the caller puts it)."""
        caps = msg.capabilities.to_dict()
        if msg.node:  # stored with the capabilities: where the cell runs, for operators only
            caps["node"] = msg.node
        if msg.model:  # the model it runs: which RL jobs it may serve (scheduler/control/jobmodels.py)
            caps["model"] = msg.model
        row = self.ctx.store.fleet.get_cell(msg.cell_id)
        if row is None:
            row = CellRow(msg.cell_id, msg.incarnation, "joining", 1, msg.version, msg.address,
                          msg.store_port, caps, msg.kv_blocks_total, 0, msg.max_running)
            row.history.append(("joining", time.time(), f"registered as {msg.incarnation}"))
        elif row.incarnation == msg.incarnation:
            if row.state == "down":
                raise Conflict(f"incarnation {msg.incarnation} of {msg.cell_id} was fenced", code="fenced")
        else:
            if row.state != "down":
                self.fence_in_tx(fx, row, f"replaced by incarnation {msg.incarnation}")
            set_state(CELL, row, "joining", f"new incarnation {msg.incarnation}")
            row.incarnation, row.generation = msg.incarnation, row.generation + 1
        row.address, row.store_port, row.capabilities = msg.address, msg.store_port, caps
        row.kv_blocks_total, row.max_running, row.version = msg.kv_blocks_total, msg.max_running, msg.version
        return row

    # ------------------------------------------------------------------ sync
    def _current(self, cell_id: str, incarnation: str) -> SyncView:
        row = self.ctx.store.fleet.sync_view(cell_id)
        if row is None:
            raise NotFound(f"unknown cell {cell_id!r}: register first")
        if row.incarnation != incarnation:
            raise Conflict(f"incarnation {incarnation} of {cell_id} is stale", code="stale_incarnation")
        if row.state == "down" or cell_id not in self.ctx.registry.live:
            raise Conflict(f"incarnation {incarnation} of {cell_id} is fenced", code="fenced")
        return row

    async def sync(self, cell_id: str, msg: SyncRequest) -> SyncResponse:
        ctx = self.ctx
        events = msg.events  # validated where they entered (the route): nothing here is malformed
        try:
            row = self._current(cell_id, msg.incarnation)
        except Conflict:
            self._canary_ingest(cell_id, msg)
            raise
        if ctx.registry.is_expired(cell_id):
            self.fence(cell_id, "lease expired")
            self._canary_ingest(cell_id, msg)
            raise Conflict(f"lease of {cell_id} expired", code="fenced")
        ctx.registry.renew(cell_id, ctx.cfg.lease_s, msg.summary)
        rejected: list[str] = []
        revokes: list[tuple[str, str]] = []
        finishes: list[tuple[str, str]] = []
        untrue: str | None = None
        if msg.tokens:  # token batches: NORMAL sync, committed (with those of syncs beside it) before release
            rejected, revokes, finishes, untrue = await self.group.submit(cell_id, msg.tokens)
            if cell_id not in ctx.registry.live:  # fenced while its tokens waited: judged as fenced
                raise Conflict(f"{cell_id} was fenced", code="fenced")
        if untrue is not None:
            with ctx.txn(durable=True) as fx:
                fresh = ctx.store.fleet.get_cell(cell_id)
                assert fresh is not None
                self.trust.quarantine(fx, fresh, untrue)
            raise Conflict(f"{cell_id} is quarantined: {untrue}", code="fenced")
        if revokes or finishes or events or _is_news(row, msg):  # a plain heartbeat writes nothing
            with ctx.txn(durable=True) as fx:
                self.ingest.apply_outcomes(fx, revokes, finishes)
                self.ingest.apply_events(fx, cell_id, events)
                self._observe_summary(row, msg)
        if not ctx.registry.has_commands(cell_id) and msg.wait_s > 0:
            await ctx.notifier.wait(("cell", cell_id), min(msg.wait_s, MAX_WAIT_S))
            if cell_id not in ctx.registry.live:  # fenced while parked
                raise Conflict(f"{cell_id} was fenced", code="fenced")
        return SyncResponse(commands=ctx.registry.take(cell_id), rejected=rejected)

    def _canary_ingest(self, cell_id: str, msg: SyncRequest) -> None:
        """TEST ONLY (the fault campaign's canary, fence off): a fenced incarnation's token
        batches are stored before it is told it is fenced, as a scheduler without the fence
        would; the store's own token history must then show them."""
        if CANARY_NO_FENCING and msg.tokens:
            with self.ctx.txn(durable=False) as fx:
                self.ingest.accept_tokens(fx, cell_id, msg.tokens)

    def _observe_summary(self, row: SyncView, msg: SyncRequest) -> None:
        fresh = self.ctx.store.fleet.get_cell(row.id)
        assert fresh is not None
        if not _is_news(fresh, msg):
            return
        s = msg.summary
        fresh.version, fresh.kv_blocks_used = s.version, s.kv_blocks_used
        fresh.kv_blocks_total = s.kv_blocks_total or fresh.kv_blocks_total
        if fresh.state == "joining":
            # a fresh cell serves only a version within the staleness bound: until its fetch of the
            # current one completes (Versions.catch_up tells it) it is `loading`, given no request
            if self.versions.servable(s.version, fresh.id):
                set_state(CELL, fresh, "rollout", "first sync")
            else:
                set_state(CELL, fresh, "loading", f"first sync at version {s.version}: fetching the current one")
            fresh.generation += 1
        elif (fresh.state == "loading" and self.ctx.store.fleet.active_flip_for(fresh.id) is None
              and self.versions.servable(s.version, fresh.id)):  # a fresh cell's fetch completed (a flip's load is Flips._load's)
            set_state(CELL, fresh, "rollout", f"loaded version {s.version}")
            fresh.generation += 1
        self.ctx.store.fleet.put_cell(fresh)

    # ------------------------------------------------------------------ fence
    def fence(self, cell_id: str, reason: str) -> None:
        with self.ctx.txn(durable=True) as fx:
            row = self.ctx.store.fleet.get_cell(cell_id)
            if row is None or row.state == "down":
                self.ctx.registry.drop(cell_id)
                return
            self.fence_in_tx(fx, row, reason)
            self.ctx.store.fleet.put_cell(row)

    def fence_in_tx(self, fx: Effects, row: CellRow, reason: str) -> None:
        """Mark the cell's current incarnation down and ask each concern in turn to let go of
        what it held (the caller puts the row)."""
        set_state(CELL, row, "down", reason)
        row.generation += 1
        metrics = self.ctx.metrics
        fx.later(lambda: metrics.fenced.labels("lease" if "lease" in reason else "replaced").inc())
        for holder in self.holders:
            holder.on_cell_fenced(fx, row.id, reason)
        cell_id = row.id
        fx.later(lambda: self.ctx.registry.drop(cell_id))

    # ------------------------------------------------------------------ views
    def view(self, cell_id: str | None = None) -> list[dict[str, Any]]:
        """GET /v1/cells/{id}: the cell's row, its live load and its remaining lease (empty: unknown);
        without an id every cell (`page` reads them a page at a time)."""
        if cell_id is None:
            return self.page(None, 1 << 62)[0]
        row = self.ctx.store.fleet.get_cell(cell_id)
        return [] if row is None else [self._view_of(row, self.ctx.store.owners.load_of(cell_id)[0])]

    def page(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
        """GET /v1/cells: up to `limit` cells with ids after `after`, in id order, and the cursor
        of the next page (None: this was the last)."""
        rows = self.ctx.store.fleet.page_cells(after, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        owned = self.ctx.store.owners.live_counts(rows[0].id, rows[-1].id) if rows else {}
        out = [self._view_of(c, owned.get(c.id, 0)) for c in rows]
        return out, (rows[-1].id if more else None)

    def _view_of(self, c: CellRow, inflight: int) -> dict[str, Any]:
        ctx = self.ctx
        d = c.to_api()
        entry = ctx.registry.live.get(c.id)
        d["inflight"] = inflight
        if entry is not None and entry.summary is not None:  # live load, not the stored copy
            d["kv_blocks_used"] = entry.summary.kv_blocks_used
        d["lease_remaining_s"] = max(0.0, entry.lease_deadline - ctx.clock()) if entry else 0.0
        d["history"] = [list(h) for h in c.history]
        return d


def _is_news(row: CellRow | SyncView, msg: SyncRequest) -> bool:
    """Does the summary change what the store records about the cell (not the volatile load)?"""
    s = msg.summary
    return (row.state == "joining" or row.version != s.version
            or bool(s.kv_blocks_total and s.kv_blocks_total != row.kv_blocks_total))

"""Who owns a request: assign, revoke, park, finish, move, place the waiting ones, reconcile
with the cells' reports.

One owner, fenced: every change of owner bumps the request's epoch (except placing a request
that has none), so whatever the previous owner still sends carries a stale epoch and is
refused. Every change runs inside `Context.txn` and takes its Effects. A move goes by the
path scheduler/control/migrations.py picks: a KV copy stays pending there until the destination
commits; a re-submit ("kv_store", "reprefill") moves the owner here at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.contract.protocol import AbortCmd, SuspendCmd
from scheduler.contract.states import REQUEST
from scheduler.control import turns
from scheduler.planner import placement
from scheduler.planner.placement import choose_destination
from scheduler.planner.types import RequestSummary, Snapshot
from scheduler.store.owners import OWNED_REQUEST_STATES, WAITING_REQUEST_STATES

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.migrations import Migrations
    from scheduler.control.registry import LiveCell
    from scheduler.planner.room import Placement
    from scheduler.store.fleet import CellRow, FlipRow
    from scheduler.store.owners import RequestRow

log = logging.getLogger("cellflip.scheduler")

MAX_PLACEMENTS_PER_TICK = 256
"""Bounds one tick's work when a dead cell leaves many requests to re-prefill."""

MAX_FRUITLESS_REPLACEMENTS = 6
"""A request taken from its owner this many times with no token committed in between is stuck
(every cell it lands on loses or stalls it): it is ended with a reason instead of re-placed
forever."""


FULL_COMPARE_PER_TICK = 50
"""Live cells whose reported request ids `reconcile_reports` compares with the store's owners
id by id each tick, whatever the counts say (10,000 cells in 200 ticks: 40 s at the default
period, a third of `stall_timeout_s`); the others are compared id by id only when the number
they report differs from the number they hold (a lost or stray request changes it)."""


class Ownership:
    """The owner of every request. Owns `progress_at` (the lost and stall rules' clock),
    `avoid_cell` (where a stalled request is not placed again) and `abort_sent` (strays told
    to go)."""

    def __init__(self, ctx: Context, migrations: Migrations, snapshot: Callable[[], Snapshot],
                 kept_placement: Callable[[], Placement]) -> None:
        self.ctx = ctx
        self.migrations = migrations
        self.snapshot = snapshot
        self.kept_placement = kept_placement  # the controller's index, brought up to date by snapshot()
        self.progress_at: dict[str, float] = {}
        """request id → monotonic time its current owner last advanced it: was given it (start
        or commit) or committed a token. The lost and stall rules of `reconcile_reports`."""
        self.avoid_cell: dict[str, str] = {}
        """request id → the cell it stalled on: not placed there again."""
        self.abort_sent: dict[str, dict[str, float]] = {}
        """cell → request id → when an `abort` was sent for a request the cell reports but does
        not own (resent once per lease while it still reports it)."""
        self._report_sweep = ctx.registry.rotation()
        """The live cells `reconcile_reports` looks at next (counts first: reported vs held)."""
        self._full_sweep = ctx.registry.rotation(FULL_COMPARE_PER_TICK)
        """The live cells `reconcile_reports` compares id by id next, whatever their counts."""
        self.fruitless: dict[str, int] = {}
        """request id → times it was taken from an owner since its last committed token."""

    def advanced(self, request_id: str, tokens: bool = False) -> None:
        """The request's current owner advanced it now (tokens committed, or a commit gave it)."""
        self.progress_at[request_id] = self.ctx.clock()
        if tokens:
            self.fruitless.pop(request_id, None)

    def _released(self, fx: Effects, req: RequestRow) -> None:
        """The request left its owner's hands (or ended): its clock and stall watch end."""
        self.progress_at.pop(req.id, None)
        self.migrations.request_ended(fx, req.id)

    def _abort_pending(self, fx: Effects, req: RequestRow, reason: str, restore: bool) -> bool:
        pending = self.migrations.pending_for(req.id)
        if pending is not None:
            self.migrations.abort(fx, pending, reason, restore=restore, tell=(pending.dst,))
        return pending is not None

    # ------------------------------------------------------------------ owner changes
    def assign(self, fx: Effects, req: RequestRow, cell_id: str, path: str | None = None) -> None:
        """Give a request without owner to `cell_id` and send it `start` (the whole context, or on
        a sticky turn only what the cell does not hold: scheduler/control/turns.py); `path` says how a moved request came ("reprefill", "kv_store"; None: placed afresh)."""
        assert req.cell_id is None, f"assign of {req.id} still owned by {req.cell_id}"
        store = self.ctx.store
        REQUEST.check(req.state, "running")
        req.cell_id, req.state, req.reason = cell_id, "running", None
        store.owners.put_request(req)
        self.migrations.trust.placed(req.id, cell_id, fresh_kv=path in (None, "reprefill"))
        cmd, delta = turns.start_command(store, req, cell_id, path)
        fx.send(cell_id, cmd)
        starts = self.ctx.metrics.starts.labels("delta" if delta else "full")
        fx.later(starts.inc)
        self.advanced(req.id)

    def prefix_missing(self, fx: Effects, cell_id: str, request_id: str, epoch: int) -> None:
        """The cell lacked the prefix a delta start named: send it the whole context (the same
        owner and epoch; nothing was started there)."""
        req = self.ctx.store.owners.get_request(request_id)
        if req is None or req.cell_id != cell_id or req.epoch != epoch or req.state != "running":
            return  # moved, ended or revoked meanwhile: whoever holds it now got its own start
        fx.send(cell_id, turns.start_command(self.ctx.store, req, cell_id, None, full=True)[0])
        fx.later(self.ctx.metrics.prefix_missing.inc)
        self.advanced(req.id)

    def revoke(self, fx: Effects, req: RequestRow, reason: str, to: str = "queued") -> None:
        """Take a live request from its owner (epoch + 1); `to` = "queued" (re-place now) or
        "suspended" (drain deadline). The old owner, if still live, is told to drop it. A request
        taken away `MAX_FRUITLESS_REPLACEMENTS` times without a token in between is stuck: it
        fails with the reason instead of being re-placed again."""
        if to == "queued":
            n = self.fruitless[req.id] = self.fruitless.get(req.id, 0) + 1
            if n >= MAX_FRUITLESS_REPLACEMENTS:
                self.fail(fx, req, f"stuck: taken from its owner {n} times with no token ({reason})")
                return
        REQUEST.check(req.state, to)
        self._abort_pending(fx, req, f"request revoked: {reason}", restore=False)
        old = req.cell_id
        req.cell_id, req.epoch, req.state, req.reason = None, req.epoch + 1, to, reason
        self.ctx.store.owners.put_request(req)
        self._released(fx, req)
        if old is not None:
            rid = req.id
            cmd = SuspendCmd if to == "suspended" else AbortCmd
            fx.send(old, lambda i: cmd(i, rid))
        self.ctx.kick()

    def rewind(self, fx: Effects, req: RequestRow, keep: int, reason: str) -> int | None:
        """Take back the request's generated tokens from `keep` on — no client was shown them
        (the caller checked) — and re-place it, so a trusted cell samples them again from
        there (with the request's own seed: the same tokens in batch-invariant mode). Its
        owner, if any, is told to drop it. Returns the tokens removed; None when the request
        was stuck and ended instead (nothing taken back). Inside a durable txn."""
        assert 0 <= keep <= req.num_generated, (req.id, keep, req.num_generated)
        if req.cell_id is not None:
            self.revoke(fx, req, f"rewound: {reason}")
            req = self.ctx.store.owners.get_request(req.id)
            if req.state == "failed":  # stuck: revoke ended it
                return None
        n = self.ctx.store.sessions.truncate(req.session_id, req.base + keep)
        req.num_generated = keep
        self.ctx.store.owners.put_request(req)
        fx.notify(("req", req.id))
        self.ctx.kick()
        return n

    def park(self, fx: Effects, req: RequestRow, reason: str) -> None:
        """Suspend a request in place: its owner keeps the KV in host memory and stays the owner
        (same epoch, so the tokens it already sampled still land); a later `place_waiting` moves
        it out by KV migration. A pending migration is aborted first (the source keeps it)."""
        if self._abort_pending(fx, req, f"request parked: {reason}", restore=True):
            req = self.ctx.store.owners.get_request(req.id)
        REQUEST.check(req.state, "parked")
        req.state, req.reason = "parked", reason
        self.ctx.store.owners.put_request(req)
        self._released(fx, req)
        rid = req.id
        fx.send(req.cell_id, lambda i: SuspendCmd(i, rid, park=True))

    def fail(self, fx: Effects, req: RequestRow, reason: str) -> None:
        """End a request that cannot go on (its client's stream ends with `reason`); the owner,
        if any, is told to drop it. The session stays open: the client may retry the turn."""
        self._abort_pending(fx, req, f"request failed: {reason}", restore=False)
        REQUEST.check(req.state, "failed")
        old = req.cell_id
        if req.is_owned:
            req.epoch += 1  # whatever the old owner still sends is refused
        req.cell_id, req.state, req.reason = None, "failed", f"error: {reason}"
        self.ctx.store.owners.put_request(req)
        self._released(fx, req)
        self.avoid_cell.pop(req.id, None)
        self.fruitless.pop(req.id, None)
        if old is not None:
            rid = req.id
            fx.send(old, lambda i: AbortCmd(i, rid))
        metrics = self.ctx.metrics
        fx.later(lambda: metrics.requests_failed.inc())
        log.warning("request %s failed: %s", req.id, reason)
        fx.notify(("req", req.id))

    def finish(self, fx: Effects, req: RequestRow, reason: str) -> None:
        """The owner reported a finish reason: close the request (its session stays open)."""
        self._abort_pending(fx, req, "request finished before commit", restore=False)
        REQUEST.check(req.state, "finished")
        self.avoid_cell.pop(req.id, None)
        self.fruitless.pop(req.id, None)
        req.state, req.reason = "finished", reason
        self.ctx.store.owners.put_request(req)
        self._released(fx, req)
        fx.notify(("req", req.id))

    def move(self, fx: Effects, req: RequestRow, src: CellRow, dst: CellRow, flip: FlipRow | None,
             hint: str | None = None) -> str:
        """Move `req` from `src` to `dst` by the path `Migrations.path_for` picks; returns it.
        A KV copy stays pending until the destination commits; a re-submit moves the owner now.
        Runs inside a durable txn."""
        path = self.migrations.path_for(src, dst, hint)
        if path == "kv":
            self.migrations.start_copy(fx, req, src, dst, flip)
            return path
        self.migrations.record_resubmit(fx, req, src, dst, flip, path)
        self.revoke(fx, req, f"{path} on {dst.id}")
        if req.state == "failed":  # stuck: revoke ended it instead of taking it for the move
            self.migrations.stalls.aborted(req.id)
            return path
        self.assign(fx, req, dst.id, path=path)
        self.migrations.resubmitted(req.id)
        return path

    def summarize(self, req: RequestRow) -> RequestSummary:
        return RequestSummary(req.id, req.num_tokens, self._last_version(req), req.session_id)

    def _last_version(self, req: RequestRow) -> int | None:
        if req.num_generated:
            end = req.base + req.num_generated
            last = self.ctx.store.sessions.read(req.session_id, end - 1, end)
            if last:
                return last.versions[-1]
        return None

    # ------------------------------------------------------------------ the loop's side
    def place_waiting(self) -> int:
        """Resume waiting requests on cells with room, oldest first; returns count. Queued and
        suspended ones re-prefill; parked ones move out of their parked copy by KV migration
        (re-prefill where the planner finds no KV path)."""
        ctx = self.ctx
        waiting = ctx.store.owners.requests_in((*WAITING_REQUEST_STATES, "parked"), limit=MAX_PLACEMENTS_PER_TICK)
        if not waiting:
            return 0
        if all(req.state != "parked" and req.id not in self.avoid_cell for req in waiting):
            return self._place_queue(waiting)
        snapshot, room = self.snapshot(), self.kept_placement()  # each placement uses up its room there
        placed = 0
        with ctx.txn(durable=True) as fx:
            for req in waiting:
                parked_on = ctx.store.fleet.get_cell(req.cell_id) if req.state == "parked" else None
                if req.state == "parked" and (parked_on is None or parked_on.id not in ctx.registry.live):
                    continue  # its owner is not live: fencing re-queues it
                summary, only = self.summarize(req), ctx.placeable(req.session_id, None)  # its job's cells
                if parked_on is not None:
                    dst = choose_destination(snapshot, req.cell_id, summary, only, room)
                else:  # not back onto the cell it stalled on, unless no other cell has room
                    avoid = self.avoid_cell.get(req.id)
                    dst = choose_destination(snapshot, avoid, summary, only, room) or (
                        choose_destination(snapshot, None, summary, only, room) if avoid else None)
                if dst is None:
                    break
                self.avoid_cell.pop(req.id, None)
                if parked_on is not None:
                    dst_row = ctx.store.fleet.get_cell(dst.cell_id)
                    assert dst_row is not None
                    self.move(fx, req, parked_on, dst_row, None, dst.path)
                else:
                    self.assign(fx, req, dst.cell_id)
                placed += 1
        return placed

    def _place_queue(self, waiting: list[RequestRow]) -> int:
        """Queued and suspended requests with no cell to avoid (the common case: a dead cell's
        requests, a burst of new sessions), placed oldest first in one pass over the fleet,
        up to the first that finds no room (those behind it wait with it)."""
        by_job: dict[int, tuple] = {}  # one pass per RL job, over its own cells (one job: one pass)
        for r in waiting:
            only = self.ctx.placeable(r.session_id, None)
            by_job.setdefault(id(only), (only, []))[1].append(r)
        snapshot, choices, room = self.snapshot(), {}, self.kept_placement()
        for only, reqs in by_job.values():
            got = placement.choose_destinations(snapshot, None, [self.summarize(r) for r in reqs], True, only, room)
            choices.update((r.id, d) for r, d in zip(reqs, got, strict=True))
        placed = 0
        with self.ctx.txn(durable=True) as fx:
            for req in waiting:
                dst = choices[req.id]
                if dst is None:
                    break
                self.assign(fx, req, dst.cell_id)
                placed += 1
        return placed

    def reconcile_reports(self) -> None:
        """Compare each cell's reported request ids with the store's owners (level-triggered).

        - owned and running, but not reported for a lease after it was handed over (or last
          advanced): the cell lost it (a start command lost, a crash-restart of the engine):
          re-place at epoch + 1;
        - owned, running and reported, but no token committed for `stall_timeout_s`: the cell
          holds it without decoding it: re-place it at epoch + 1 on another cell;
        - reported but not owned (and not an incoming migration): tell the cell to drop it.

        Visits the live cells a slice a tick (`Registry.rotation`): each within a few ticks.
        """
        incoming = {(m.dst, m.request_id) for m in self.ctx.store.owners.pending_migrations()}
        into = {dst for dst, _ in incoming}
        live = self.ctx.registry.live
        full = self._full_sweep.next()
        whole = set(full)
        visit = list(dict.fromkeys(self._report_sweep.next() + full))
        holding = self.ctx.store.owners.owned_counts(visit)
        for cell_id in visit:
            entry = live.get(cell_id)
            if entry is None or entry.summary is None or not (entry.summary.request_ids or cell_id in holding):
                continue  # holds nothing and reports nothing: nothing to compare
            if (cell_id not in whole and cell_id not in into
                    and len(entry.summary.request_ids) == holding.get(cell_id, 0)):
                continue  # as many reported as held: compared id by id on the slower full sweep
            reported = set(entry.summary.request_ids)
            owned = self.ctx.store.owners.owned_states(cell_id)
            self._revoke_lost(cell_id, entry, owned, reported)
            self._revoke_stalled(cell_id, owned, reported)
            self._drop_strays(cell_id, set(owned), reported, incoming)

    def _since_progress(self, rid: str, now: float) -> float:
        return now - self.progress_at.get(rid, self.ctx.started_at)

    def _rows(self, ids: list[str]) -> list[RequestRow]:
        rows = [self.ctx.store.owners.get_request(rid) for rid in ids]
        return [r for r in rows if r is not None]

    def _revoke_lost(self, cell_id: str, entry: LiveCell, owned: dict[str, str], reported: set[str]) -> None:
        lease = self.ctx.cfg.lease_s
        lost = [rid for rid, state in owned.items() if state in ("running", "parked") and rid not in reported
                and self._since_progress(rid, entry.summary_at) > lease]
        if lost:
            with self.ctx.txn(durable=True) as fx:
                for req in self._rows(sorted(lost)):
                    self.revoke(fx, req, f"owner {cell_id} stopped reporting it")

    def _revoke_stalled(self, cell_id: str, owned: dict[str, str], reported: set[str]) -> None:
        ctx, limit = self.ctx, self.ctx.cfg.stall_timeout_s
        now = ctx.clock()
        stalled = [rid for rid, state in owned.items() if state == "running" and rid in reported
                   and self._since_progress(rid, now) > limit]
        if not stalled:
            return
        log.warning("cell %s reports %d requests it has not advanced for %.0fs: re-placing them elsewhere",
                    cell_id, len(stalled), limit)
        with ctx.txn(durable=True) as fx:
            for req in self._rows(sorted(stalled)):
                self.revoke(fx, req, f"no token from {cell_id} for {limit:g}s")
                self.avoid_cell[req.id] = cell_id
                fx.later(lambda: ctx.metrics.requests_stalled.labels(cell_id).inc())

    def _drop_strays(self, cell_id: str, owned: set[str], reported: set[str],
                     incoming: set[tuple[str, str]]) -> None:
        now, lease = self.ctx.clock(), self.ctx.cfg.lease_s
        sent = self.abort_sent.setdefault(cell_id, {})
        for rid in reported - owned:
            if (cell_id, rid) in incoming or now - sent.get(rid, float("-inf")) < lease:
                continue
            sent[rid] = now
            self.ctx.registry.send(cell_id, lambda i, rid=rid: AbortCmd(i, rid))
        for rid in list(sent):
            if rid not in reported:
                del sent[rid]

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None:
        """Every request the cell owned is re-placed at epoch + 1 (its pending migrations are
        aborted before this is asked)."""
        self.abort_sent.pop(cell_id, None)
        for req in self.ctx.store.owners.requests_on(cell_id, OWNED_REQUEST_STATES):
            self.revoke(fx, req, f"owner {cell_id} fenced: {reason}")

    def integrity_problems(self) -> list[str]:
        """Ownership invariants, checked at idle time and by tests; returns what is violated.
        Reads only."""
        store = self.ctx.store
        problems = []
        pending = {m.request_id: m for m in store.owners.pending_migrations()}
        cells = {c.id: c for c in store.fleet.list_cells()}
        for req in store.owners.requests_in((*WAITING_REQUEST_STATES, *OWNED_REQUEST_STATES), limit=1 << 30):
            if req.is_owned and req.cell_id is None:
                problems.append(f"{req.id} is {req.state} without an owner")
            if not req.is_owned and req.cell_id is not None:
                problems.append(f"{req.id} is {req.state} but owned by {req.cell_id}")
            if req.is_owned and req.cell_id in cells and cells[req.cell_id].state == "down":
                problems.append(f"{req.id} is owned by down cell {req.cell_id}")
            m = pending.pop(req.id, None)
            if (req.state == "migrating") != (m is not None):
                problems.append(f"{req.id} is {req.state} with pending migration {m.id if m else None}")
            elif m is not None and (m.src, m.epoch) != (req.cell_id, req.epoch):
                problems.append(f"migration {m.id} is from {m.src}@{m.epoch}, owner is {req.cell_id}@{req.epoch}")
        problems += [f"migration {m.id} pending for a {mid} request that is not live" for mid, m in pending.items()]
        active = [f.cell_id for f in store.fleet.list_flips(active_only=True)]
        problems += [f"cell {c} has {active.count(c)} active flips" for c in set(active) if active.count(c) > 1]
        return problems

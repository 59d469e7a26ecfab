"""Who owns a request: assign, revoke, finish, place the waiting ones, reconcile with reports.

One owner, fenced: every change of owner bumps the request's epoch (except placing a request
that has none), so whatever the previous owner still sends carries a stale epoch and is
refused. Every function here runs inside `Controller.txn` and takes its Effects.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from scheduler import migrations
from scheduler.placement import RequestSummary, Snapshot, choose_destination
from scheduler.protocol import AbortCmd, StartCmd, SuspendCmd
from scheduler.states import REQUEST
from scheduler.store.owners import OWNED_REQUEST_STATES, WAITING_REQUEST_STATES, RequestRow

if TYPE_CHECKING:
    from scheduler.controller import Controller, Effects

log = logging.getLogger("cellflip.scheduler")

MAX_PLACEMENTS_PER_TICK = 256
"""Bounds one tick's work when a dead cell leaves many requests to re-prefill."""


def assign(ctl: Controller, fx: Effects, req: RequestRow, cell_id: str, path: str | None = None) -> None:
    """Give a request without owner to `cell_id` and send it `start` with the full buffer;
    `path` says how a moved request came ("reprefill", "kv_store"; None: placed afresh)."""
    assert req.cell_id is None, f"assign of {req.id} still owned by {req.cell_id}"
    REQUEST.check(req.state, "running")
    req.cell_id, req.state, req.reason = cell_id, "running", None
    ctl.store.owners.put_request(req)
    token_ids = ctl.store.sessions.token_ids(req.session_id, req.prompt_start, req.base + req.num_generated)
    prompt_len = req.base - req.prompt_start
    rid, epoch, sid, n, params = req.id, req.epoch, req.session_id, req.num_generated, dict(req.params)
    fx.send(cell_id, lambda i: StartCmd(i, rid, epoch, sid, token_ids, prompt_len, n, params, path))
    ctl.progress_at[req.id] = ctl.clock()


def revoke(ctl: Controller, fx: Effects, req: RequestRow, reason: str, to: str = "queued") -> None:
    """Take a live request from its owner (epoch + 1); `to` = "queued" (re-place now) or
    "suspended" (drain deadline). The old owner, if still live, is told to drop it."""
    REQUEST.check(req.state, to)
    pending = ctl.store.owners.pending_migration_for(req.id)
    if pending is not None:
        migrations.abort_in_tx(ctl, fx, pending, f"request revoked: {reason}", restore=False,
                               tell=(pending.dst,))
    old = req.cell_id
    req.cell_id, req.epoch, req.state, req.reason = None, req.epoch + 1, to, reason
    ctl.store.owners.put_request(req)
    ctl.progress_at.pop(req.id, None)
    migrations.observe_stall(ctl, fx, ctl.stalls.ended(req.id))
    if old is not None:
        rid = req.id
        cmd = SuspendCmd if to == "suspended" else AbortCmd
        fx.send(old, lambda i: cmd(i, rid))
    ctl.kick()


def park(ctl: Controller, fx: Effects, req: RequestRow, reason: str) -> None:
    """Suspend a request in place: its owner keeps the KV in host memory and stays the owner
    (same epoch, so the tokens it already sampled still land); a later `place_waiting` moves
    it out by KV migration. A pending migration is aborted first (the source keeps it)."""
    pending = ctl.store.owners.pending_migration_for(req.id)
    if pending is not None:
        migrations.abort_in_tx(ctl, fx, pending, f"request parked: {reason}", tell=(pending.dst,))
        req = ctl.store.owners.get_request(req.id)
    REQUEST.check(req.state, "parked")
    req.state, req.reason = "parked", reason
    ctl.store.owners.put_request(req)
    ctl.progress_at.pop(req.id, None)
    migrations.observe_stall(ctl, fx, ctl.stalls.ended(req.id))
    rid = req.id
    fx.send(req.cell_id, lambda i: SuspendCmd(i, rid, park=True))


def finish(ctl: Controller, fx: Effects, req: RequestRow, reason: str) -> None:
    """The owner reported a finish reason: close the request (its session stays open)."""
    pending = ctl.store.owners.pending_migration_for(req.id)
    if pending is not None:
        migrations.abort_in_tx(ctl, fx, pending, "request finished before commit", restore=False,
                               tell=(pending.dst,))
    REQUEST.check(req.state, "finished")
    ctl.avoid_cell.pop(req.id, None)
    req.state, req.reason = "finished", reason
    ctl.store.owners.put_request(req)
    ctl.progress_at.pop(req.id, None)
    migrations.observe_stall(ctl, fx, ctl.stalls.ended(req.id))
    fx.notify(("req", req.id))


def summarize(ctl: Controller, req: RequestRow) -> RequestSummary:
    return RequestSummary(req.id, req.num_tokens, _last_version(ctl, req), req.session_id)


def _last_version(ctl: Controller, req: RequestRow) -> int | None:
    if req.num_generated:
        rows = ctl.store.sessions.read(req.session_id, req.base + req.num_generated - 1, req.base + req.num_generated)
        if rows:
            return rows[0][3]
    return None


def bump(snapshot: Snapshot, cell_id: str) -> Snapshot:
    """The snapshot after one more request landed on `cell_id` (decisions within one tick)."""
    cells = tuple(dataclasses.replace(c, inflight=c.inflight + 1) if c.cell_id == cell_id else c
                  for c in snapshot.cells)
    return dataclasses.replace(snapshot, cells=cells)


def place_waiting(ctl: Controller) -> int:
    """Resume waiting requests on cells with room, oldest first; returns count. Queued and
    suspended ones re-prefill; parked ones move out of their parked copy by KV migration
    (re-prefill where the planner finds no KV path)."""
    waiting = ctl.store.owners.requests_in((*WAITING_REQUEST_STATES, "parked"), limit=MAX_PLACEMENTS_PER_TICK)
    if not waiting:
        return 0
    snapshot = ctl.snapshot()
    placed = 0
    with ctl.txn(durable=True) as fx:
        for req in waiting:
            parked_on = ctl.store.fleet.get_cell(req.cell_id) if req.state == "parked" else None
            if req.state == "parked" and (parked_on is None or parked_on.id not in ctl.registry.live):
                continue  # its owner is not live: fencing re-queues it
            summary = summarize(ctl, req)
            if parked_on is not None:
                dst = choose_destination(snapshot, req.cell_id, summary)
            else:  # not back onto the cell it stalled on, unless no other cell has room
                avoid = ctl.avoid_cell.get(req.id)
                dst = choose_destination(snapshot, avoid, summary) or (
                    choose_destination(snapshot, None, summary) if avoid else None)
            if dst is None:
                break
            ctl.avoid_cell.pop(req.id, None)
            if parked_on is not None:
                dst_row = ctl.store.fleet.get_cell(dst.cell_id)
                assert dst_row is not None
                migrations.start(ctl, fx, req, parked_on, dst_row, None, dst.path)
            else:
                assign(ctl, fx, req, dst.cell_id)
            snapshot = bump(snapshot, dst.cell_id)
            placed += 1
    return placed


def reconcile_reports(ctl: Controller) -> None:
    """Compare each cell's reported request ids with the store's owners (level-triggered).

    - owned and running, but not reported for a lease after it was handed over (or last
      advanced): the cell lost it (a start command lost, a crash-restart of the engine):
      re-place at epoch + 1;
    - owned, running and reported, but no token committed for `stall_timeout_s`: the cell
      holds it without decoding it: re-place it at epoch + 1 on another cell;
    - reported but not owned (and not an incoming migration): tell the cell to drop it.
    """
    now = ctl.clock()
    lease = ctl.cfg.lease_s
    incoming = {(m.dst, m.request_id) for m in ctl.store.owners.pending_migrations()}
    for cell_id, entry in list(ctl.registry.live.items()):
        if entry.summary is None:
            continue
        reported = set(entry.summary.request_ids)
        owned = ctl.store.owners.requests_on(cell_id, OWNED_REQUEST_STATES)
        lost = [r for r in owned if r.state in ("running", "parked") and r.id not in reported
                and entry.summary_at - ctl.progress_at.get(r.id, ctl.started_at) > lease]
        if lost:
            with ctl.txn(durable=True) as fx:
                for req in lost:
                    revoke(ctl, fx, req, f"owner {cell_id} stopped reporting it")
        stalled = [r for r in owned if r.state == "running" and r.id in reported
                   and now - ctl.progress_at.get(r.id, ctl.started_at) > ctl.cfg.stall_timeout_s]
        if stalled:
            log.warning("cell %s reports %d requests it has not advanced for %.0fs: re-placing them elsewhere",
                        cell_id, len(stalled), ctl.cfg.stall_timeout_s)
            with ctl.txn(durable=True) as fx:
                for req in stalled:
                    revoke(ctl, fx, req, f"no token from {cell_id} for {ctl.cfg.stall_timeout_s:g}s")
                    ctl.avoid_cell[req.id] = cell_id
                    fx.later(lambda c=cell_id: ctl.metrics.requests_stalled.labels(c).inc())
        owned_ids = {r.id for r in owned}
        for rid in reported - owned_ids:
            if (cell_id, rid) in incoming or now - entry.abort_sent.get(rid, float("-inf")) < lease:
                continue
            entry.abort_sent[rid] = now
            ctl.registry.send(cell_id, lambda i, rid=rid: AbortCmd(i, rid))
        for rid in list(entry.abort_sent):
            if rid not in reported:
                del entry.abort_sent[rid]


def integrity_problems(ctl: Controller) -> list[str]:
    """Ownership invariants, checked at idle time and by tests; returns what is violated.
    Reads only."""
    problems = []
    pending = {m.request_id: m for m in ctl.store.owners.pending_migrations()}
    cells = {c.id: c for c in ctl.store.fleet.list_cells()}
    for req in ctl.store.owners.requests_in((*WAITING_REQUEST_STATES, *OWNED_REQUEST_STATES), limit=1 << 30):
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
    active = [f.cell_id for f in ctl.store.fleet.list_flips(active_only=True)]
    problems += [f"cell {c} has {active.count(c)} active flips" for c in set(active) if active.count(c) > 1]
    return problems

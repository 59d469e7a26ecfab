"""Cell membership: register, sync (heartbeat + tokens + events ⇄ commands), fence.

One line per sync: check incarnation and lease → renew the lease → commit tokens (then wake
client streams) → apply ownership outcomes and events durably → long-poll for commands.

Fencing is the only way a cell incarnation leaves: a lost lease or a new incarnation under the
same id marks it `down` (generation + 1); its requests are re-placed at epoch + 1, its pending
migrations aborted and its flip failed, so nothing it sends later is accepted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from scheduler import ingest, migrations, ownership, versions
from scheduler.errors import Conflict, NotFound
from scheduler.protocol import (
    MAX_WAIT_S,
    RegisterRequest,
    RegisterResponse,
    SyncRequest,
    SyncResponse,
    decode_event,
)
from scheduler.states import CELL, set_state
from scheduler.store.fleet import CellRow
from scheduler.store.owners import OWNED_REQUEST_STATES

if TYPE_CHECKING:
    from scheduler.controller import Controller, Effects


def register(ctl: Controller, msg: RegisterRequest) -> RegisterResponse:
    """Join (or re-join after a scheduler restart) the fleet. A new incarnation fences the old."""
    caps = msg.capabilities.to_dict()
    if msg.node:  # stored with the capabilities: where the cell runs, for operators only
        caps["node"] = msg.node
    known = ctl.store.fleet.get_cell(msg.cell_id)
    if (known is not None and known.incarnation == msg.incarnation and known.state != "down"
            and ctl.registry.is_expired(msg.cell_id)):  # its lease ran out: same rule as a sync
        fence(ctl, msg.cell_id, "lease expired")
        raise Conflict(f"lease of {msg.cell_id} expired", code="fenced")
    with ctl.txn(durable=True) as fx:
        row = ctl.store.fleet.get_cell(msg.cell_id)
        if row is None:
            row = CellRow(msg.cell_id, msg.incarnation, "joining", 1, msg.version, msg.address,
                          msg.store_port, caps, msg.kv_blocks_total, 0, msg.max_running)
            row.history.append(("joining", time.time(), f"registered as {msg.incarnation}"))
        elif row.incarnation == msg.incarnation:
            if row.state == "down":
                raise Conflict(f"incarnation {msg.incarnation} of {msg.cell_id} was fenced", code="fenced")
        else:
            if row.state != "down":
                fence_in_tx(ctl, fx, row, f"replaced by incarnation {msg.incarnation}")
            set_state(CELL, row, "joining", f"new incarnation {msg.incarnation}")
            row.incarnation, row.generation = msg.incarnation, row.generation + 1
        row.address, row.store_port, row.capabilities = msg.address, msg.store_port, caps
        row.kv_blocks_total, row.max_running, row.version = msg.kv_blocks_total, msg.max_running, msg.version
        ctl.store.fleet.put_cell(row)
    if row.state == "joining":  # a new process: what the old one was told to load does not carry over
        for key in [k for k in ctl.version_sent if k[0] == msg.cell_id]:
            del ctl.version_sent[key]
    entry = ctl.registry.live.get(msg.cell_id)
    if entry is not None and row.state != "joining":
        entry.lease_deadline, entry.seen = ctl.clock() + ctl.cfg.lease_s, True
    else:
        ctl.registry.admit(msg.cell_id, ctl.cfg.lease_s, seen=True)
    ctl.kick()
    return RegisterResponse(row.generation, ctl.cfg.lease_s, ctl.cfg.heartbeat_s)


def _current(ctl: Controller, cell_id: str, incarnation: str) -> CellRow:
    row = ctl.store.fleet.get_cell(cell_id)
    if row is None:
        raise NotFound(f"unknown cell {cell_id!r}: register first")
    if row.incarnation != incarnation:
        raise Conflict(f"incarnation {incarnation} of {cell_id} is stale", code="stale_incarnation")
    if row.state == "down" or cell_id not in ctl.registry.live:
        raise Conflict(f"incarnation {incarnation} of {cell_id} is fenced", code="fenced")
    return row


async def sync(ctl: Controller, cell_id: str, msg: SyncRequest) -> SyncResponse:
    events = [decode_event(e) for e in msg.events]  # 422 before anything is committed
    ingest.check_events(events)
    row = _current(ctl, cell_id, msg.incarnation)
    if ctl.registry.is_expired(cell_id):
        fence(ctl, cell_id, "lease expired")
        raise Conflict(f"lease of {cell_id} expired", code="fenced")
    ctl.registry.renew(cell_id, ctl.cfg.lease_s, msg.summary)
    rejected: list[str] = []
    revokes: list[tuple[str, str]] = []
    finishes: list[tuple[str, str]] = []
    if msg.tokens:
        with ctl.txn(durable=False) as fx:  # token batches: NORMAL sync, committed before release
            rejected, revokes, finishes = ingest.accept_tokens(ctl, fx, cell_id, msg.tokens)
    if revokes or finishes or events or _is_news(row, msg):  # a plain heartbeat writes nothing
        with ctl.txn(durable=True) as fx:
            ingest.apply_outcomes(ctl, fx, revokes, finishes)
            ingest.apply_events(ctl, fx, cell_id, events)
            _observe_summary(ctl, row, msg)
    if not ctl.registry.has_commands(cell_id) and msg.wait_s > 0:
        await ctl.notifier.wait(("cell", cell_id), min(msg.wait_s, MAX_WAIT_S))
        if cell_id not in ctl.registry.live:  # fenced while parked
            raise Conflict(f"{cell_id} was fenced", code="fenced")
    return SyncResponse(commands=ctl.registry.take(cell_id), rejected=rejected)


def _is_news(row: CellRow, msg: SyncRequest) -> bool:
    """Does the summary change what the store records about the cell (not the volatile load)?"""
    s = msg.summary
    return (row.state == "joining" or row.version != s.version
            or bool(s.kv_blocks_total and s.kv_blocks_total != row.kv_blocks_total))


def _observe_summary(ctl: Controller, row: CellRow, msg: SyncRequest) -> None:
    fresh = ctl.store.fleet.get_cell(row.id)
    assert fresh is not None
    if not _is_news(fresh, msg):
        return
    s = msg.summary
    fresh.version, fresh.kv_blocks_used = s.version, s.kv_blocks_used
    fresh.kv_blocks_total = s.kv_blocks_total or fresh.kv_blocks_total
    if fresh.state == "joining":
        # a fresh cell serves only a version within the staleness bound: until its fetch of the
        # current one completes (versions.catch_up tells it) it is `loading`, given no request
        if versions.servable(ctl, s.version):
            set_state(CELL, fresh, "rollout", "first sync")
        else:
            set_state(CELL, fresh, "loading", f"first sync at version {s.version}: fetching the current one")
        fresh.generation += 1
    elif (fresh.state == "loading" and ctl.store.fleet.active_flip_for(fresh.id) is None
          and versions.servable(ctl, s.version)):  # a fresh cell's fetch completed (a flip's load is flips._load's)
        set_state(CELL, fresh, "rollout", f"loaded version {s.version}")
        fresh.generation += 1
    ctl.store.fleet.put_cell(fresh)


def fence(ctl: Controller, cell_id: str, reason: str) -> None:
    with ctl.txn(durable=True) as fx:
        row = ctl.store.fleet.get_cell(cell_id)
        if row is None or row.state == "down":
            ctl.registry.drop(cell_id)
            return
        fence_in_tx(ctl, fx, row, reason)
        ctl.store.fleet.put_cell(row)


def fence_in_tx(ctl: Controller, fx: Effects, row: CellRow, reason: str) -> None:
    """Mark the cell's current incarnation down and undo everything it held (caller puts row)."""
    from scheduler import flips

    set_state(CELL, row, "down", reason)
    row.generation += 1
    fx.later(lambda: ctl.metrics.fenced.labels("lease" if "lease" in reason else "replaced").inc())
    for mig in ctl.store.owners.pending_migrations():
        if row.id in (mig.src, mig.dst):
            other = mig.dst if mig.src == row.id else mig.src
            migrations.abort_in_tx(ctl, fx, mig, f"{row.id} fenced: {reason}", restore=True, tell=(other,))
    for req in ctl.store.owners.requests_on(row.id, OWNED_REQUEST_STATES):
        ownership.revoke(ctl, fx, req, f"owner {row.id} fenced: {reason}")
    flip = ctl.store.fleet.active_flip_for(row.id)
    if flip is not None:
        flips.finish(ctl, fx, flip, "failed", f"cell lost: {reason}")
    cell_id = row.id
    fx.later(lambda: ctl.registry.drop(cell_id))

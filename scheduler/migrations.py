"""Live migration, scheduler side: issue, commit (compare-and-set), abort, time out.

One line: reserve → copy while decoding → stop, copy the tail → import, ack → record owner →
resume → free. The scheduler's part is the "record owner" step: the destination's commit
moves ownership (src, e) → (dst, e + 1) and the migration pending → committed in one durable
transaction; the source keeps ownership (and keeps decoding) on any failure before that.

Paths (`path_for`): "kv" when both cells export KV and serve the same version; "kv_store"
when both read and write the same shared KV store (SGLang HiCache with a storage backend) and
serve the same version; otherwise "reprefill". On the last two, ownership moves at once
(epoch + 1) and the destination re-submits the session's token buffer: on "kv_store" its
prefix match loads the blocks the source's engine wrote to the store and recomputes only what
the store lacks (the source's abort and the destination's start are not ordered, so a block
written late is recomputed: the same tokens, only slower); on "reprefill" it recomputes all
(on its own version when versions differ: the per-token versions record the truth).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler import ownership
from scheduler.errors import Conflict, NotFound
from scheduler.protocol import (
    AbortCmd,
    AbortMigrationRequest,
    CancelMigrationCmd,
    CommitRequest,
    CommitResponse,
    MigrateInCmd,
    MigrateOutCmd,
)
from scheduler.states import MIGRATION, REQUEST, set_state
from scheduler.store.fleet import CellRow, FlipRow
from scheduler.store.owners import MigrationRow, RequestRow

if TYPE_CHECKING:
    from scheduler.controller import Controller, Effects

CANARY_NO_FENCING = os.environ.get("CELLFLIP_CANARY_NO_FENCING") == "1"
"""TEST ONLY, inert unless set; never set it outside the fault campaign's canary run
(cells/faults, bench/faults.py), which proves its checkers can fail. When set (read once, at
import): a commit or abort from a fenced incarnation is not refused, and a source's abort
after the destination's commit won is answered as if the abort had won, so the source resumes
beside the new owner (split ownership)."""


def timeout_s(ctl: Controller) -> float:
    """A pending migration older than this is aborted: every copy round plus the
    stop-and-copy and the import may each take up to one transfer timeout."""
    return ctl.mig_cfg.transfer_timeout_s * (ctl.mig_cfg.max_copy_rounds + 2)


def path_for(ctl: Controller, src: CellRow, dst: CellRow, hint: str | None = None) -> str:
    """The path a move from `src` to `dst` takes: the planner's `hint` where both ends support
    it, else the best path they do. KV (copied or from a store) is reused only between cells
    serving the same version."""
    src_v, dst_v = ctl.snapshot_version(src.id), ctl.snapshot_version(dst.id)
    same_version = src_v is not None and src_v == dst_v
    kv = same_version and bool(src.capabilities.get("kv_export")) and bool(dst.capabilities.get("kv_export"))
    store = src.capabilities.get("kv_store")
    kv_store = same_version and bool(store) and store == dst.capabilities.get("kv_store")
    if hint == "reprefill":
        return "reprefill"
    if hint == "kv_store" and kv_store:
        return "kv_store"
    return "kv" if kv else "kv_store" if kv_store else "reprefill"


_RESUBMIT_REASONS = {
    "kv_store": "kv store: the destination loads the shared prefix, recomputing what is missing",
    "reprefill": "re-prefill: no KV path between these cells",
}


def start(ctl: Controller, fx: Effects, req: RequestRow, src: CellRow, dst: CellRow, flip: FlipRow | None,
          hint: str | None = None) -> str:
    """Move `req` from `src` to `dst`; returns the path taken (`path_for`). Runs inside a
    durable txn."""
    path = path_for(ctl, src, dst, hint)
    mig = MigrationRow(f"mig-{uuid.uuid4().hex[:16]}", req.id, src.id, dst.id, req.epoch, "pending",
                       path, flip.id if flip else None, src_state=req.state)
    mig.history.append(("pending", time.time(), f"{src.id} -> {dst.id}"))
    if path != "kv":  # ownership moves now; the destination re-submits the session's tokens
        set_state(MIGRATION, mig, "committed", _RESUBMIT_REASONS[path])
        mig.finished_at = time.time()
        ctl.store.owners.put_migration(mig)
        ownership.revoke(ctl, fx, req, f"{path} on {dst.id}")
        ownership.assign(ctl, fx, req, dst.id, path=path)
        fx.later(lambda: ctl.metrics.migrations.labels("committed", path).inc())
        if flip is not None:
            if path == "kv_store":
                flip.kv_store += 1
            else:
                flip.recomputed += 1
        return path
    REQUEST.check(req.state, "migrating")
    req.state = "migrating"
    ctl.store.owners.put_request(req)
    ctl.store.owners.put_migration(mig)
    ctl.migration_started[mig.id] = ctl.clock()
    ctl.stalls.started(req.id, ctl.clock())
    block = int(dst.capabilities.get("block_size") or 16)
    reserve = req.num_tokens + ctl.mig_cfg.headroom_blocks * block
    rid, epoch, mid = req.id, req.epoch, mig.id
    fx.send(src.id, lambda i: MigrateOutCmd(i, rid, epoch, mid, dst.id, dst.address, dst.store_port))
    fx.send(dst.id, lambda i: MigrateInCmd(i, rid, mid, src.id, src.address, src.store_port, reserve, epoch))
    return "kv"


def abort_in_tx(ctl: Controller, fx: Effects, mig: MigrationRow, reason: str, *, restore: bool = True,
                tell: Iterable[str] = ()) -> None:
    """pending → aborted; with `restore` the request goes back to running on its source.
    Cells in `tell` get `cancel_migration` (the source resumes, the destination frees)."""
    set_state(MIGRATION, mig, "aborted", reason)
    mig.reason, mig.finished_at = reason, time.time()
    ctl.store.owners.put_migration(mig)
    ctl.migration_started.pop(mig.id, None)
    ctl.stalls.aborted(mig.request_id)
    req = ctl.store.owners.get_request(mig.request_id)
    if restore and req is not None and req.state == "migrating":
        REQUEST.check("migrating", mig.src_state)
        req.state = mig.src_state
        ctl.store.owners.put_request(req)
    rid, mid, path = mig.request_id, mig.id, mig.path
    for cell_id in tell:
        fx.send(cell_id, lambda i: CancelMigrationCmd(i, rid, mid))
    fx.later(lambda: ctl.metrics.migrations.labels("aborted", path).inc())


def _check_party(ctl: Controller, cell_id: str, incarnation: str) -> None:
    if CANARY_NO_FENCING:  # test-only canary, see above
        return
    cell = ctl.store.fleet.get_cell(cell_id)
    if cell is None or cell.incarnation != incarnation or cell.state == "down" or ctl.registry.is_expired(cell_id):
        raise Conflict(f"cell {cell_id} incarnation {incarnation} is fenced", code="fenced")


def commit(ctl: Controller, migration_id: str, body: CommitRequest) -> CommitResponse:
    """The destination's compare-and-set; see the protocol module for the 409 reasons."""
    with ctl.txn(durable=True) as fx:
        outcome = _commit_in_tx(ctl, fx, migration_id, body)
    if isinstance(outcome, Conflict):
        raise outcome
    return CommitResponse(epoch=outcome)


def _commit_in_tx(ctl: Controller, fx: Effects, migration_id: str, body: CommitRequest) -> int | Conflict:
    mig = ctl.store.owners.get_migration(migration_id)
    if mig is None:
        raise NotFound(f"unknown migration {migration_id!r}")
    if body.cell_id != mig.dst:
        raise Conflict(f"{body.cell_id} is not the destination of {migration_id}", code="not_destination")
    _check_party(ctl, body.cell_id, body.incarnation)
    req = ctl.store.owners.get_request(mig.request_id)
    assert req is not None, f"migration {mig.id} of a missing request"
    if mig.state == "committed":  # a retried commit whose answer was lost
        if req.cell_id == mig.dst and req.epoch == mig.epoch + 1 and body.epoch == mig.epoch:
            return req.epoch
        return Conflict("ownership moved on since this commit", code="stale_epoch")
    if mig.state == "aborted":
        return Conflict(f"migration aborted: {mig.reason}", code="finished" if req.state == "finished" else "aborted")
    if body.epoch != mig.epoch or req.epoch != mig.epoch or req.cell_id != mig.src or req.state != "migrating":
        abort_in_tx(ctl, fx, mig, "stale epoch at commit", tell=(mig.src,))
        return Conflict("the source no longer owns the request at this epoch", code="stale_epoch")
    n, tail = req.num_generated, body.tail
    if tail.start > n:
        return Conflict(f"tail starts at {tail.start} but {n} tokens are stored", code="gap")
    stored = ctl.store.sessions.read(req.session_id, req.base + tail.start, req.base + n)
    overlap = tail.records[: n - tail.start]
    if any((s[0], s[2], s[3]) != (r[0], float(r[1]), r[2]) for s, r in zip(stored, overlap, strict=False)):
        fx.later(ctl.metrics.drift.inc)
        abort_in_tx(ctl, fx, mig, "tail differs from stored tokens", tell=(mig.src,))
        return Conflict("tail differs from the stored tokens", code="mismatch")
    new = tail.records[n - tail.start:]
    if n + len(new) != body.num_tokens:
        abort_in_tx(ctl, fx, mig, "token count mismatch at commit", tell=(mig.src,))
        return Conflict(f"store has {n + len(new)} tokens, destination {body.num_tokens}", code="length_mismatch")
    if new:
        ctl.store.sessions.append_sampled(req.session_id, req.base + n, new)
        req.num_generated = n + len(new)
        ctl.stalls.on_tokens(req.id, len(new), ctl.clock())  # the tail reaches clients now
        fx.later(lambda k=len(new): ctl.metrics.tokens_generated.inc(k))
        fx.notify(("req", req.id))
    ctl.stalls.committed(req.id)
    path = body.path or mig.path
    set_state(MIGRATION, mig, "committed", f"owner {mig.src}@{mig.epoch} -> {mig.dst}@{mig.epoch + 1}")
    mig.path, mig.finished_at = path, time.time()
    ctl.store.owners.put_migration(mig)
    ctl.migration_started.pop(mig.id, None)
    REQUEST.check(req.state, "running")
    req.cell_id, req.epoch, req.state = mig.dst, req.epoch + 1, "running"
    ctl.store.owners.put_request(req)
    ctl.progress_at[req.id] = ctl.clock()
    if mig.flip_id is not None and (flip := ctl.store.fleet.get_flip(mig.flip_id)) is not None:
        flip.migrated += 1
        ctl.store.fleet.put_flip(flip)
    rid = req.id
    fx.send(mig.src, lambda i: AbortCmd(i, rid))  # the source frees its copy
    fx.later(lambda: ctl.metrics.migrations.labels("committed", path).inc())
    return req.epoch


def observe_stall(ctl: Controller, fx: Effects, stall_s: float | None) -> None:
    """A finished move's client-visible stall (scheduler/stallmeter.py) into its histogram."""
    if stall_s is not None:
        fx.later(lambda: ctl.metrics.migration_downtime.observe(stall_s))


def abort_by_cell(ctl: Controller, migration_id: str, body: AbortMigrationRequest) -> dict:
    """A party gives up before commit: 200 if it was pending (or already aborted), 409 if the
    commit already won (the caller must then not resume)."""
    with ctl.txn(durable=True) as fx:
        mig = ctl.store.owners.get_migration(migration_id)
        if mig is None:
            raise NotFound(f"unknown migration {migration_id!r}")
        if body.cell_id not in (mig.src, mig.dst):
            raise Conflict(f"{body.cell_id} is not a party of {migration_id}", code="not_party")
        _check_party(ctl, body.cell_id, body.incarnation)
        if mig.state == "committed" and not CANARY_NO_FENCING:  # the canary lets the loser resume
            raise Conflict("migration already committed", code="committed")
        if mig.state == "pending":
            other = mig.dst if body.cell_id == mig.src else mig.src
            abort_in_tx(ctl, fx, mig, body.reason or f"aborted by {body.cell_id}", tell=(other,))
    return {"id": migration_id, "state": "aborted"}


def expire(ctl: Controller) -> None:
    """Abort pending migrations past their timeout (both parties are told)."""
    now, limit = ctl.clock(), timeout_s(ctl)
    late = [m for m in ctl.store.owners.pending_migrations()
            if now - ctl.migration_started.setdefault(m.id, now) > limit]
    if late:
        with ctl.txn(durable=True) as fx:
            for m in late:
                abort_in_tx(ctl, fx, m, f"timed out after {limit:.0f}s", tell=(m.src, m.dst))

"""Live migration, scheduler side: issue, commit (compare-and-set), abort, time out.

One line: reserve → copy while decoding → stop, copy the tail → import, ack → record owner →
resume → free. The scheduler's part is the "record owner" step: the destination's commit
moves ownership (src, e) → (dst, e + 1) and the migration pending → committed in one durable
transaction; the source keeps ownership (and keeps decoding) on any failure before that. That
commit is the one owner change made here; every other one is scheduler/control/ownership.py's.

Paths (`Migrations.path_for`, taken by scheduler/control/ownership.py's `move`): "kv" when both cells
export KV and serve the same version; "kv_store" when both read and write the same shared KV
store (SGLang HiCache with a storage backend) and serve the same version; otherwise
"reprefill". On the last two, ownership moves at once (epoch + 1) and the destination
re-submits the session's token buffer: on "kv_store" its prefix match loads the blocks the
source's engine wrote to the store and recomputes only what the store lacks (the source's
abort and the destination's start are not ordered, so a block written late is recomputed: the
same tokens, only slower); on "reprefill" it recomputes all (on its own version when versions
differ: the per-token versions record the truth)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler.contract.errors import Conflict, NotFound
from scheduler.contract.failpoints import CANARY_NO_FENCING
from scheduler.contract.protocol import (
    AbortCmd,
    AbortMigrationRequest,
    CancelMigrationCmd,
    CommitRequest,
    CommitResponse,
    MigrateInCmd,
    MigrateOutCmd,
)
from scheduler.contract.records import same_tokens
from scheduler.contract.states import MIGRATION, REQUEST, set_state
from scheduler.control.stallmeter import Stall, StallMeter
from scheduler.store.owners import MigrationRow

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.trust import Trust
    from scheduler.control.versions import Versions
    from scheduler.store.fleet import CellRow, FlipRow
    from scheduler.store.owners import RequestRow


_RESUBMIT_REASONS = {
    "kv_store": "kv store: the destination loads the shared prefix, recomputing what is missing",
    "reprefill": "re-prefill: no KV path between these cells",
}


class Migrations:
    """Migration records and the KV copy protocol. Owns `started` (when each pending copy
    began, for its timeout) and `stalls` (the client-visible stall of each move)."""

    def __init__(self, ctx: Context, versions: Versions, trust: Trust) -> None:
        self.ctx = ctx
        self.versions = versions
        self.trust = trust
        now = ctx.clock()
        self.started: dict[str, float] = {m.id: now for m in ctx.store.owners.pending_migrations()}
        """migration id → monotonic time the pending copy began (restarts at now after a restart)."""
        self.stalls = StallMeter()
        """Client-visible stall of each live migration, from the token arrivals here."""

    @property
    def timeout_s(self) -> float:
        """A pending migration older than this is aborted: every copy round plus the
        stop-and-copy and the import may each take up to one transfer timeout."""
        cfg = self.ctx.mig_cfg
        return cfg.transfer_timeout_s * (cfg.max_copy_rounds + 2)

    def path_for(self, src: CellRow, dst: CellRow, hint: str | None = None) -> str:
        """The path a move from `src` to `dst` takes: the planner's `hint` where both ends
        support it, else the best path they do. KV (copied or from a store) is reused only
        between cells serving the same version."""
        src_v, dst_v = self.versions.served_by(src.id), self.versions.served_by(dst.id)
        same_version = src_v is not None and src_v == dst_v
        kv = same_version and bool(src.capabilities.get("kv_export")) and bool(dst.capabilities.get("kv_export"))
        store = src.capabilities.get("kv_store")
        kv_store = same_version and bool(store) and store == dst.capabilities.get("kv_store")
        if hint == "reprefill":
            return "reprefill"
        if hint == "kv_store" and kv_store:
            return "kv_store"
        return "kv" if kv else "kv_store" if kv_store else "reprefill"

    def pending_for(self, request_id: str) -> MigrationRow | None:
        return self.ctx.store.owners.pending_migration_for(request_id)

    # ------------------------------------------------------------------ start
    def record_resubmit(self, fx: Effects, req: RequestRow, src: CellRow, dst: CellRow, flip: FlipRow | None,
                        path: str) -> None:
        """A move by `path` ("kv_store" or "reprefill"), recorded as committed at once: the
        caller moves the owner and the destination re-submits the session's tokens."""
        mig = MigrationRow(f"mig-{uuid.uuid4().hex[:16]}", req.id, src.id, dst.id, req.epoch, "pending",
                           path, flip.id if flip else None, src_state=req.state)
        mig.history.append(("pending", time.time(), f"{src.id} -> {dst.id}"))
        set_state(MIGRATION, mig, "committed", _RESUBMIT_REASONS[path])
        mig.finished_at = time.time()
        self.ctx.store.owners.put_migration(mig)
        self.stalls.started(req.id, self.ctx.clock(), (mig.id, path))  # committed once the owner moved
        fx.later(lambda: self.ctx.metrics.migrations.labels("committed", path).inc())
        if flip is not None:
            if path == "kv_store":
                flip.kv_store += 1
            else:
                flip.recomputed += 1

    def start_copy(self, fx: Effects, req: RequestRow, src: CellRow, dst: CellRow, flip: FlipRow | None) -> None:
        """Move `req` from `src` to `dst` by KV copy: pending until the destination commits.
        Runs inside a durable txn."""
        ctx = self.ctx
        mig = MigrationRow(f"mig-{uuid.uuid4().hex[:16]}", req.id, src.id, dst.id, req.epoch, "pending",
                           "kv", flip.id if flip else None, src_state=req.state)
        mig.history.append(("pending", time.time(), f"{src.id} -> {dst.id}"))
        REQUEST.check(req.state, "migrating")
        req.state = "migrating"
        ctx.store.owners.put_request(req)
        ctx.store.owners.put_migration(mig)
        self.started[mig.id] = ctx.clock()
        self.stalls.started(req.id, ctx.clock(), (mig.id, "kv"))
        block = int(dst.capabilities.get("block_size") or 16)
        reserve = req.num_tokens + ctx.mig_cfg.headroom_blocks * block
        rid, epoch, mid = req.id, req.epoch, mig.id
        fx.send(src.id, lambda i: MigrateOutCmd(i, rid, epoch, mid, dst.id, dst.address, dst.store_port))
        fx.send(dst.id, lambda i: MigrateInCmd(i, rid, mid, src.id, src.address, src.store_port, reserve, epoch))

    # ------------------------------------------------------------------ abort
    def abort(self, fx: Effects, mig: MigrationRow, reason: str, *, restore: bool = True,
              tell: Iterable[str] = ()) -> None:
        """pending → aborted; with `restore` the request goes back to its state before the move
        (running, or parked) on its source. Cells in `tell` get `cancel_migration` (the source
        resumes, the destination frees)."""
        ctx = self.ctx
        set_state(MIGRATION, mig, "aborted", reason)
        mig.reason, mig.finished_at = reason, time.time()
        ctx.store.owners.put_migration(mig)
        self.started.pop(mig.id, None)
        self.stalls.aborted(mig.request_id)
        req = ctx.store.owners.get_request(mig.request_id)
        if restore and req is not None and req.state == "migrating":
            REQUEST.check("migrating", mig.src_state)
            req.state = mig.src_state
            ctx.store.owners.put_request(req)
        rid, mid, path = mig.request_id, mig.id, mig.path
        for cell_id in tell:
            fx.send(cell_id, lambda i: CancelMigrationCmd(i, rid, mid))
        fx.later(lambda: ctx.metrics.migrations.labels("aborted", path).inc())

    def abort_by_cell(self, migration_id: str, body: AbortMigrationRequest) -> dict:
        """A party gives up before commit: 200 if it was pending (or already aborted), 409 if
        the commit already won (the caller must then not resume)."""
        with self.ctx.txn(durable=True) as fx:
            mig = self.ctx.store.owners.get_migration(migration_id)
            if mig is None:
                raise NotFound(f"unknown migration {migration_id!r}")
            if body.cell_id not in (mig.src, mig.dst):
                raise Conflict(f"{body.cell_id} is not a party of {migration_id}", code="not_party")
            self._check_party(body.cell_id, body.incarnation)
            if mig.state == "committed" and not CANARY_NO_FENCING:  # the canary lets the loser resume
                raise Conflict("migration already committed", code="committed")
            if mig.state == "pending":
                other = mig.dst if body.cell_id == mig.src else mig.src
                self.abort(fx, mig, body.reason or f"aborted by {body.cell_id}", tell=(other,))
        return {"id": migration_id, "state": "aborted"}

    def expire(self) -> None:
        """Abort pending migrations past their timeout (both parties are told)."""
        now, limit = self.ctx.clock(), self.timeout_s
        late = [m for m in self.ctx.store.owners.pending_migrations()
                if now - self.started.setdefault(m.id, now) > limit]
        if late:
            with self.ctx.txn(durable=True) as fx:
                for m in late:
                    self.abort(fx, m, f"timed out after {limit:.0f}s", tell=(m.src, m.dst))

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None:
        """Abort every pending migration the cell is a party of; the other party is told."""
        for mig in self.ctx.store.owners.pending_migrations():
            if cell_id in (mig.src, mig.dst):
                other = mig.dst if mig.src == cell_id else mig.src
                self.abort(fx, mig, f"{cell_id} fenced: {reason}", restore=True, tell=(other,))

    # ------------------------------------------------------------------ commit
    def _check_party(self, cell_id: str, incarnation: str) -> None:
        if CANARY_NO_FENCING:  # test-only canary, see above
            return
        cell = self.ctx.store.fleet.get_cell(cell_id)
        if (cell is None or cell.incarnation != incarnation or cell.state == "down"
                or self.ctx.registry.is_expired(cell_id)):
            raise Conflict(f"cell {cell_id} incarnation {incarnation} is fenced", code="fenced")

    def commit(self, migration_id: str, body: CommitRequest) -> tuple[CommitResponse, str | None]:
        """The destination's compare-and-set; see the protocol module for the 409 reasons.
        Returns the answer and the id of the request whose owner moved now (None when a
        retried commit is answered again)."""
        with self.ctx.txn(durable=True) as fx:
            outcome = self._commit_in_tx(fx, migration_id, body)
        if isinstance(outcome, Conflict):
            raise outcome
        return CommitResponse(epoch=outcome[0]), outcome[1]

    def _commit_in_tx(self, fx: Effects, migration_id: str, body: CommitRequest) -> tuple[int, str | None] | Conflict:
        owners = self.ctx.store.owners
        mig = owners.get_migration(migration_id)
        if mig is None:
            raise NotFound(f"unknown migration {migration_id!r}")
        if body.cell_id != mig.dst:
            raise Conflict(f"{body.cell_id} is not the destination of {migration_id}", code="not_destination")
        self._check_party(body.cell_id, body.incarnation)
        req = owners.get_request(mig.request_id)
        assert req is not None, f"migration {mig.id} of a missing request"
        if mig.state == "committed":  # a retried commit whose answer was lost
            if req.cell_id == mig.dst and req.epoch == mig.epoch + 1 and body.epoch == mig.epoch:
                return req.epoch, None
            return Conflict("ownership moved on since this commit", code="stale_epoch")
        if mig.state == "aborted":
            return Conflict(f"migration aborted: {mig.reason}", code="finished" if req.state == "finished" else "aborted")
        if body.epoch != mig.epoch or req.epoch != mig.epoch or req.cell_id != mig.src or req.state != "migrating":
            self.abort(fx, mig, "stale epoch at commit", tell=(mig.src,))
            return Conflict("the source no longer owns the request at this epoch", code="stale_epoch")
        refused = self._append_tail(fx, mig, req, body)
        if refused is not None:
            return refused
        self._move_owner(fx, mig, req, body.path or mig.path)
        return req.epoch, req.id

    def _append_tail(self, fx: Effects, mig: MigrationRow, req: RequestRow, body: CommitRequest) -> Conflict | None:
        """Check the destination's tail against the stored tokens and store what is new."""
        ctx = self.ctx
        n, tail = req.num_generated, body.tail
        if tail.start > n:
            return Conflict(f"tail starts at {tail.start} but {n} tokens are stored", code="gap")
        stored = ctx.store.sessions.read(req.session_id, req.base + tail.start, req.base + n)
        if not same_tokens(stored, tail.records[: n - tail.start]):
            fx.later(ctx.metrics.drift.inc)
            self.abort(fx, mig, "tail differs from stored tokens", tell=(mig.src,))
            return Conflict("tail differs from the stored tokens", code="mismatch")
        new = tail.records[n - tail.start:]
        if (why := self.trust.invalid_records(mig.src, new)) is not None:
            self.abort(fx, mig, f"invalid tail: {why}", tell=(mig.src,))
            return Conflict(f"the tail cannot be true: {why}", code="invalid")
        if n + len(new) != body.num_tokens:
            self.abort(fx, mig, "token count mismatch at commit", tell=(mig.src,))
            return Conflict(f"store has {n + len(new)} tokens, destination {body.num_tokens}",
                            code="length_mismatch")
        if new:
            # sampled by the source: the destination only carried them over
            ctx.store.sessions.append_sampled(req.session_id, req.base + n, new, mig.epoch + 1, mig.src)
            req.num_generated = n + len(new)
            self.stalls.on_tokens(req.id, len(new), ctx.clock())  # the tail reaches clients now
            fx.later(lambda k=len(new): ctx.metrics.tokens_generated.inc(k))
            fx.notify(("req", req.id))
        return None

    def _move_owner(self, fx: Effects, mig: MigrationRow, req: RequestRow, path: str) -> None:
        """(src, e) → (dst, e + 1) and pending → committed, in the caller's durable txn."""
        ctx = self.ctx
        self.stalls.committed(req.id)
        set_state(MIGRATION, mig, "committed", f"owner {mig.src}@{mig.epoch} -> {mig.dst}@{mig.epoch + 1}")
        mig.path, mig.finished_at, mig.commit_tokens = path, time.time(), req.num_generated
        ctx.store.owners.put_migration(mig)
        self.started.pop(mig.id, None)
        REQUEST.check(req.state, "running")
        req.cell_id, req.epoch, req.state = mig.dst, req.epoch + 1, "running"
        ctx.store.owners.put_request(req)
        self.trust.placed(req.id, mig.dst, fresh_kv=path == "reprefill")
        if mig.flip_id is not None and (flip := ctx.store.fleet.get_flip(mig.flip_id)) is not None:
            flip.migrated += 1
            ctx.store.fleet.put_flip(flip)
        rid = req.id
        fx.send(mig.src, lambda i: AbortCmd(i, rid))  # the source frees its copy
        fx.later(lambda: ctx.metrics.migrations.labels("committed", path).inc())

    # ------------------------------------------------------------------ stall measurement
    def _observe_stall(self, fx: Effects, stall: Stall | None) -> None:
        """A finished move's client-visible stall (scheduler/control/stallmeter.py) onto its
        migration row (every path) and, for a KV copy, into the downtime histogram."""
        if stall is None:
            return
        mig_id, path = stall.tag
        self.ctx.store.owners.set_migration_stall(mig_id, stall.seconds)
        if path == "kv":
            fx.later(lambda s=stall.seconds: self.ctx.metrics.migration_downtime.observe(s))

    def resubmitted(self, request_id: str) -> None:
        """A re-submit move's owner change is done (its commit): its stall window runs on."""
        self.stalls.committed(request_id)

    def tokens_arrived(self, fx: Effects, request_id: str, n: int) -> None:
        """`n` tokens of the request were committed now (a move's stall window may close)."""
        self._observe_stall(fx, self.stalls.on_tokens(request_id, n, self.ctx.clock()))

    def tokens_arrived_many(self, fx: Effects, grown: dict[str, int]) -> None:
        """`tokens_arrived` for each (request id, tokens) of a sync, at one clock reading."""
        now, on_tokens = self.ctx.clock(), self.stalls.on_tokens
        for rid, n in grown.items():
            if (stall := on_tokens(rid, n, now)) is not None:
                self._observe_stall(fx, stall)

    def request_ended(self, fx: Effects, request_id: str) -> None:
        """The request finished or left its owner: a committed move still watched is measured."""
        self._observe_stall(fx, self.stalls.ended(request_id))

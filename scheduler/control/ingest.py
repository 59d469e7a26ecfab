"""What a sync brings in: token batches (judged by pure rules) and cell events.

Token rule: a batch is accepted only from the request's current owner at its current epoch
(the fence; the fault campaign's canary turns it off, scheduler/contract/failpoints.py),
and only when it continues the stored tokens exactly (`start` == stored count; an overlap with
stored tokens must match them bit for bit and is then idempotent). `judge` decides (pure);
`Ingest` applies, through the concerns that own what changes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.contract.failpoints import CANARY_NO_FENCING
from scheduler.contract.protocol import (
    BroadcastEvent,
    ExportedEvent,
    Message,
    MigrationEvent,
    PrefixMissingEvent,
    RoleFailedEvent,
    ScoredEvent,
    TokenBatch,
    dispatch,
)
from scheduler.contract.records import StoredTokens, TokenRecords, same_tokens

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.exports import Exports
    from scheduler.control.flips import Flips
    from scheduler.control.migrations import Migrations
    from scheduler.control.ownership import Ownership
    from scheduler.control.scoring import Scoring
    from scheduler.control.trust import Trust
    from scheduler.store.owners import RequestRow

log = logging.getLogger("cellflip.scheduler")


@dataclass(frozen=True, slots=True)
class Verdict:
    accept: bool
    new: TokenRecords = field(default_factory=TokenRecords)
    """Records past the stored end, to append (empty for an exact duplicate)."""
    reason: str = ""
    revoke: bool = False
    """The owner itself sent an impossible batch (gap, mismatch): take the request away."""
    drift: bool = False
    """A token differs from the one stored at its index."""


def judge(req: RequestRow | None, cell_id: str, batch: TokenBatch, stored: StoredTokens,
          logprobs_checked: bool = False) -> Verdict:
    """Pure decision for one batch; `stored` holds the stored tokens overlapping it.
    Mutates nothing. `logprobs_checked`: the caller found every log-prob of the batch finite
    and <= 0 already (a sync's columns, judged at once by `Trust.invalid_batches`)."""
    if req is None:
        return Verdict(False, reason="unknown_request")
    if not CANARY_NO_FENCING:  # the fence (the fault campaign's canary turns it off)
        if req.cell_id != cell_id:
            return Verdict(False, reason="not_owner")
        if req.epoch != batch.epoch:
            return Verdict(False, reason="stale_epoch")
    if not logprobs_checked and not _finite_nonpositive(batch.records.logprobs):
        return Verdict(False, reason="invalid", revoke=req.is_owned)  # a log-prob must be finite and <= 0
    n = req.num_generated
    if batch.start > n:
        return Verdict(False, reason="gap", revoke=req.is_owned)
    seen = n - batch.start  # records already stored (a duplicate's overlap)
    if seen > 0 and not same_tokens(stored, batch.records[:seen]):
        return Verdict(False, reason="mismatch", revoke=req.is_owned, drift=True)
    new = batch.records[seen:] if seen > 0 else batch.records
    if not req.is_owned and new and not CANARY_NO_FENCING:  # the canary also stores a fenced owner's tokens
        return Verdict(False, reason="not_running")
    return Verdict(True, new=new)


def _finite_nonpositive(logprobs: tuple[float, ...]) -> bool:
    """Every log-prob is a finite number <= 0: by the column's sum and greatest value (C speed),
    value by value only when those cannot tell."""
    try:
        if not logprobs or (math.isfinite(math.fsum(logprobs)) and max(logprobs) <= 0):
            return True
    except (TypeError, OverflowError):
        pass
    return all(isinstance(lp, int | float) and math.isfinite(lp) and lp <= 0 for lp in logprobs)


Outcomes = tuple[list[str], list[tuple[str, str]], list[tuple[str, str]], str | None]
"""(rejected request ids, revocations [(id, reason)], finishes [(id, finish_reason)], why the
cell must be quarantined or None); a revocation whose reason starts with `FAIL` ends the request
instead of re-placing it."""

FAIL = "fail: "
"""Prefix of a revocation that ends the request (it cannot go on anywhere)."""


_NONE_STORED = StoredTokens()
"""A batch that overlaps nothing stored (read-only: shared by every such batch)."""


class _Appends:
    """Accepted tokens not written yet: (session, at, records, epoch, cell) rows, the tokens each
    request grew by, and each session's length counting them."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths
        self.rows: list[tuple[str, int, TokenRecords, int, str | None]] = []
        self.grown: dict[str, int] = {}

    def add(self, req: RequestRow, new: TokenRecords, epoch: int, cell_id: str) -> None:
        at = req.base + req.num_generated
        self.rows.append((req.session_id, at, new, epoch, cell_id))
        self.lengths[req.session_id] = at + len(new)
        req.num_generated += len(new)
        self.grown[req.id] = self.grown.get(req.id, 0) + len(new)


class Ingest:
    """Applies what a sync brings in, through the concerns that own the state it changes.
    Holds no state of its own."""

    def __init__(self, ctx: Context, ownership: Ownership, migrations: Migrations, scoring: Scoring,
                 flips: Flips, trust: Trust, exports: Exports) -> None:
        self.ctx = ctx
        self.trust = trust
        self.exports = exports
        self.ownership = ownership
        self.migrations = migrations
        self.scoring = scoring
        self.flips = flips

    def accept_tokens(self, fx: Effects, cell_id: str, batches: list[TokenBatch]) -> Outcomes:
        """Phase 1 (non-durable txn): append accepted tokens. Returns the rejected ids and the
        ownership outcomes for the durable phase 2. The batches' requests and sessions are read
        at once and the accepted tokens written in one statement (`_Appends`): a sync of 32
        batches costs a few statements, not a few per batch."""
        ctx = self.ctx
        rejected: list[str] = []
        revokes: list[tuple[str, str]] = []
        finishes: list[tuple[str, str]] = []
        if (why := self.trust.invalid_batches(cell_id, batches)) is not None:
            # what no honest engine reports: nothing of this sync is taken, the cell goes
            fx.later(lambda: ctx.metrics.tokens_rejected.labels("untrue").inc())
            return [x.request_id for x in batches], [], [], why
        reqs, lengths = ctx.store.owners.for_tokens([b.request_id for b in batches])
        pending = _Appends(lengths)
        for b in batches:
            req = reqs.get(b.request_id)
            stored = _NONE_STORED
            if req is not None and b.start < req.num_generated:
                self._flush(fx, pending, reqs)  # the overlap is compared with what is stored
                end = min(req.num_generated, b.start + len(b.records))
                stored = ctx.store.sessions.read(req.session_id, req.base + b.start, req.base + end)
            v = judge(req, cell_id, b, stored, logprobs_checked=True)  # invalid_batches judged them
            if not v.accept:
                rejected.append(b.request_id)
                fx.later(lambda r=v.reason: ctx.metrics.tokens_rejected.labels(r).inc())
                if v.drift:
                    fx.later(ctx.metrics.drift.inc)
                if v.revoke:
                    revokes.append((b.request_id, f"{v.reason} in tokens from {cell_id}"))
                continue
            assert req is not None
            if req.cell_id != cell_id or req.epoch != b.epoch:  # only with the fence off
                ctx.store.owners.record_foreign_batch(req, cell_id, b.epoch, b.start, len(b.records), len(v.new))
            if v.new and pending.lengths.get(req.session_id, 0) != req.base + req.num_generated:
                # the session's buffer moved on under the request (only a bug or a race can do
                # this): it cannot continue where its tokens would land; end it with the reason
                rejected.append(b.request_id)
                fx.later(lambda: ctx.metrics.tokens_rejected.labels("misaligned").inc())
                revokes.append((b.request_id, f"{FAIL}the session's buffer changed under the request"))
                continue
            if v.new:
                pending.add(req, v.new, b.epoch, cell_id)
            if b.finish_reason is not None and req.is_owned:
                finishes.append((req.id, b.finish_reason))
        self._flush(fx, pending, reqs)
        return rejected, revokes, finishes, None

    def _flush(self, fx: Effects, pending: _Appends, reqs: dict[str, RequestRow]) -> None:
        """Write the planned appends: every token row in one statement, then each request's count."""
        if not pending.rows:
            return
        ctx = self.ctx
        before: dict[str, int] = {}
        for sid, at, *_ in pending.rows:  # each session's length as read in this transaction
            before.setdefault(sid, at)
        ctx.store.sessions.append_sampled_many(pending.rows, lengths=before)
        ctx.store.owners.set_num_generated_many([(rid, reqs[rid].num_generated) for rid in pending.grown])
        for rid in pending.grown:
            self.ownership.advanced(rid, tokens=True)
        self.migrations.tokens_arrived_many(fx, pending.grown)
        fx.notify_many([("req", rid) for rid in pending.grown])
        total = sum(pending.grown.values())
        fx.later(lambda: ctx.metrics.tokens_generated.inc(total))
        pending.rows, pending.grown = [], {}

    def apply_outcomes(self, fx: Effects, revokes: list[tuple[str, str]], finishes: list[tuple[str, str]]) -> None:
        """Phase 2 (durable txn): ownership changes decided in phase 1."""
        owners = self.ctx.store.owners
        for rid, reason in revokes:
            req = owners.get_request(rid)
            if req is not None and req.is_owned:
                if reason.startswith(FAIL):
                    self.ownership.fail(fx, req, reason[len(FAIL):])
                else:
                    self.ownership.revoke(fx, req, reason)
        for rid, finish_reason in finishes:
            req = owners.get_request(rid)
            if req is not None and req.is_owned:
                self.ownership.finish(fx, req, finish_reason)

    def apply_events(self, fx: Effects, cell_id: str, events: list[Message]) -> None:
        handlers = {
            MigrationEvent.type: lambda e: self._on_migration(fx, e),
            ScoredEvent.type: lambda e: self.scoring.on_scored(fx, cell_id, e),
            BroadcastEvent.type: lambda e: self._on_broadcast(fx, e),
            RoleFailedEvent.type: lambda e: self.flips.role_failed(fx, cell_id, e.flip_id, e.reason),
            ExportedEvent.type: lambda e: self.exports.on_exported(fx, cell_id, e),
            PrefixMissingEvent.type: lambda e: self.ownership.prefix_missing(fx, cell_id, e.request_id, e.epoch),
        }
        for e in events:
            dispatch(handlers, e)

    def _on_migration(self, fx: Effects, e: MigrationEvent) -> None:
        metrics = self.ctx.metrics

        def observe() -> None:
            if e.bytes > 0:
                metrics.migration_bytes.inc(e.bytes)
        fx.later(observe)

    def _on_broadcast(self, fx: Effects, e: BroadcastEvent) -> None:
        if e.ok and e.seconds >= 0:
            fx.later(lambda: self.ctx.metrics.broadcast.observe(e.seconds))
        if not e.ok:
            log.warning("version %d did not arrive by %s: %s", e.version, e.mode, e.reason)
            if not e.activate:
                self.scoring.on_fetch_failed(e.version, e.reason)

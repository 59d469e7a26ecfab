"""Token-in/token-out completions on top of the session store.

One line: admit (a new session within the staleness bound, and a rollout cell has room, else
429) → align the prompt with the session's
buffer by length and running hash (append the new tokens; a rewritten history starts a new
segment) → record the request
and its owner → `start` on that cell → stream tokens as they are committed.

A client only ever reads tokens back from the store, after the sync that carried them has
committed: nothing is shown that a scheduler restart could take back.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from scheduler.contract.errors import Conflict, Invalid, NoCapacity
from scheduler.contract.prefixhash import PrefixHash
from scheduler.contract.records import StoredTokens
from scheduler.contract.sampling import SamplingParams
from scheduler.control import idempotency
from scheduler.planner.placement import choose_destination, sticky_destination
from scheduler.planner.types import RequestSummary
from scheduler.store.owners import RequestRow

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.ownership import Ownership
    from scheduler.control.staleness import Staleness
    from scheduler.control.trust import Trust
    from scheduler.planner.types import Destination, Snapshot

IDEMPOTENCY_SCOPE = "completions"

FOLLOW_POLL_S = 1.0
"""A waiting stream re-reads the store at least this often (a missed wake-up costs ≤ 1 s)."""
SHOWN_KEPT = 1 << 16
"""Requests whose shown watermark is remembered; an older one counts as wholly shown."""


class Completions:
    """Admission and streaming of completions. A request is the store's, its owner
    `Ownership`'s; this holds only what clients of this process were shown of each request
    (`shown`) and the rewinds their followers must apply (`rewinds`).

    What a client was shown is final: a sampler quarantined later (scheduler/control/trust.py)
    can take back only the tokens no client saw. A live stream shows each token as it yields
    it; a whole answer (`/v1/generate` or a chat turn without `stream`) shows nothing until it
    returns, so its tokens stay rewindable until then. Only requests submitted by this process
    are tracked: after a restart, whatever a client saw before it is unknown, so every older
    request counts as wholly shown."""

    def __init__(self, ctx: Context, ownership: Ownership, staleness: Staleness,
                 snapshot: Callable[[], Snapshot], trust: Trust) -> None:
        self.ctx = ctx
        self.trust = trust
        self.ownership = ownership
        self.staleness = staleness
        self.snapshot = snapshot
        self.shown: OrderedDict[str, int] = OrderedDict()
        """request id → buffer index up to which a client was shown its tokens."""
        self.rewinds: dict[str, list[int]] = {}
        """request id → the generated-token counts it was rewound to, in order (rare: only a
        quarantine rewinds)."""

    def submit(self, session_id: str | None, prompt_ids: list[int], params: SamplingParams,
               idempotency_key: str | None = None, agent: str | None = None,
               request_id: str | None = None) -> RequestRow:
        """Admit and start one completion; returns the request (already owned by a cell).
        Under an Idempotency-Key, a replay returns the request the first call started (the
        client follows it again from its first token: a dropped connection never starts a
        second rollout); the same key with another body is a 409. The key is recorded with the
        request, durably. `agent`: the calling agent token's id (None for a trainer or admin
        token), which owns a session it opens and may use no other's (404 as for an unknown
        one); its Idempotency-Keys are its own. `request_id`: a replay's own id (the route allows
        it only with `scheduler.store.replay_request_ids`); one the store holds is a 409."""
        ctx = self.ctx
        scope = IDEMPOTENCY_SCOPE if agent is None else f"{IDEMPOTENCY_SCOPE}:{agent}"
        fp = idempotency.fingerprint([session_id, list(prompt_ids), params.model_dump(mode="json")])
        hit = idempotency.replay(ctx.store, scope, idempotency_key, fp)
        if hit is not None:
            first = ctx.store.owners.get_request(hit["request_id"])
            assert first is not None, f"idempotency record of a request the store lacks: {hit}"
            return first
        self.check(session_id, prompt_ids, params, agent)
        self.staleness.check_admission(session_id)
        if request_id is not None and ctx.store.owners.get_request(request_id) is not None:
            raise Conflict(f"request {request_id!r} exists", code="request_exists")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        sid = session_id or f"anon-{rid[4:]}"
        dst = self._destination(rid, sid, len(prompt_ids), sticky=bool(session_id))
        with ctx.txn(durable=True) as fx:
            req = self._record(fx, rid, sid, prompt_ids, params, agent)
            self.ownership.assign(fx, req, dst.cell_id)
            idempotency.record(ctx.store, scope, idempotency_key, fp,
                               {"request_id": rid, "session_id": sid})
        self.shown[rid] = req.base
        while len(self.shown) > SHOWN_KEPT:
            self.shown.popitem(last=False)
        return req

    def unshown_from(self, req: RequestRow, first: int) -> bool:
        """Were the request's tokens from buffer index `first` on shown to no client?"""
        shown = self.shown.get(req.id)
        return shown is not None and req.base <= first and shown <= first

    def rewound(self, req: RequestRow, keep: int) -> None:
        """The request's generated tokens from `keep` on were taken back: followers drop them."""
        self.rewinds.setdefault(req.id, []).append(keep)

    def _show(self, req: RequestRow, upto: int) -> None:
        if req.id in self.shown and self.shown[req.id] < upto:
            self.shown[req.id] = upto

    def check(self, session_id: str | None, prompt_ids: list[int], params: SamplingParams,
              agent: str | None = None, new_ids: list[int] | None = None) -> None:
        """Everything that refuses a turn before it records anything: another agent's session
        (404), a turn already in flight (409), what a cell would refuse (422: ids outside the
        vocabulary, the context plus max_tokens past the model's length, a negative seed).
        `new_ids`: the part of `prompt_ids` not recorded yet, the only ids checked (default
        all of them)."""
        sessions = self.ctx.store.sessions
        row = sessions.get(session_id) if session_id else None
        if row is not None:
            sessions.require(session_id, agent)
            if self.ctx.store.owners.active_request_for_session(row.id) is not None:
                raise Conflict(f"session {row.id!r} has a request in flight", code="session_busy")
        context = len(prompt_ids) if prompt_ids or row is None else row.length - row.segment_starts[-1]
        self.trust.check_request(list(prompt_ids if new_ids is None else new_ids), context, params)

    def admissible(self, session_id: str | None, num_tokens: int) -> None:
        """Would a new turn be admitted now (the staleness bound, a rollout cell with room)?
        Raises the 429 it would get; places nothing."""
        self.staleness.check_admission(session_id)
        self._destination("req-admission", session_id or "anon", num_tokens, sticky=bool(session_id))

    def _destination(self, rid: str, sid: str, num_tokens: int, sticky: bool) -> Destination:
        """The session's previous cell when it has room, else the planner's choice; 429 when
        no rollout cell has room."""
        snapshot, room = self.snapshot(), self.ownership.kept_placement()  # the controller's kept index
        summary = RequestSummary(rid, num_tokens, snapshot.current_version, sid)
        last = self.ctx.store.owners.last_cell_for_session(sid) if sticky else None
        only = self.ctx.placeable(sid, None)  # its RL job's cells
        dst = (sticky_destination(snapshot, last, summary, only, room)
               or choose_destination(snapshot, None, summary, only, room))
        if dst is None:
            self.ctx.metrics.admission_rejected.inc()
            raise NoCapacity("no rollout cell has room", retry_after_s=max(1.0, self.ctx.cfg.heartbeat_s * 2))
        return dst

    def _record(self, fx: Effects, rid: str, sid: str, prompt_ids: list[int], params: SamplingParams,
                agent: str | None) -> RequestRow:
        """Align the prompt with the session's buffer and record the request (queued)."""
        ctx = self.ctx
        sessions = ctx.store.sessions
        row = sessions.ensure(sid, agent)
        if ctx.store.owners.active_request_for_session(sid) is not None:
            raise Conflict(f"session {sid!r} has a request in flight", code="session_busy")
        start = row.segment_starts[-1]
        if not prompt_ids or self._extends(sid, start, row.length, prompt_ids):
            new = prompt_ids[row.length - start:]
        else:  # the harness edited earlier turns: keep the old tokens, open a new segment
            fx.later(ctx.metrics.history_rewrites.inc)
            start, new = sessions.new_segment(sid, agent), prompt_ids
        length = sessions.append_prompt(sid, new, agent) if new else sessions.require(sid, agent).length
        if length == start:
            raise Invalid("empty prompt: send prompt_ids (the session has no tokens to continue)")
        req = RequestRow(rid, sid, base=length, prompt_start=start, num_generated=0, params=params.model_dump(mode="json"),
                         cell_id=None, epoch=1, state="queued")
        ctx.store.owners.put_request(req)
        return req

    def _extends(self, sid: str, start: int, length: int, prompt_ids: list[int]) -> bool:
        """Does `prompt_ids` start with the session's current segment [start, length)? Compared
        by length and running hash (scheduler/store/context.py): the segment is not read back."""
        held = length - start
        if len(prompt_ids) < held:
            return False
        kept = self.ctx.store.context.segment_hash(sid, start, length)
        return held == 0 or PrefixHash.of(prompt_ids[:held]).digest() == kept.digest()

    async def follow(self, request_id: str, live: bool = True) -> AsyncIterator[tuple[int, StoredTokens, RequestRow]]:
        """Yield (start, committed token rows, request) until the request is finished or
        failed; `start` is the generated-token index the rows begin at, the last item carries
        the terminal request (possibly with no rows). `live`: the consumer shows each row as it
        gets it (a stream); else it shows them all when the follow ends (a whole answer), and a
        rewind (a quarantined sampler's tokens taken back) may come first: `start` below what
        was yielded so far says to drop the rows from there."""
        ctx = self.ctx
        sent = 0
        seen_rewinds = 0
        req = ctx.store.owners.get_request(request_id)
        assert req is not None
        try:
            while True:
                req = ctx.store.owners.get_request(request_id)
                assert req is not None
                rewinds = self.rewinds.get(request_id, ())
                if len(rewinds) > seen_rewinds:
                    keep = min(rewinds[seen_rewinds:])
                    seen_rewinds = len(rewinds)
                    if keep < sent:
                        assert not live, f"{request_id} rewound to {keep} below the {sent} tokens a stream showed"
                        sent = keep
                        yield keep, StoredTokens(), req
                if req.num_generated > sent:
                    rows = ctx.store.sessions.read(req.session_id, req.base + sent, req.base + req.num_generated)
                    start, sent = sent, sent + len(rows)
                    if live:
                        self._show(req, req.base + sent)
                    yield start, rows, req
                    continue  # re-read before parking: a notify may have come while the client read
                if req.state in ("finished", "failed"):
                    yield sent, StoredTokens(), req
                    return
                await ctx.notifier.wait(("req", request_id), FOLLOW_POLL_S)
                if ctx.closing:  # shutdown: the client gets what was committed so far
                    return
        finally:  # a whole answer is shown once its follow ends (done, or closed early)
            self._show(req, req.base + sent)

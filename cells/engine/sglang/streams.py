"""The SGLang adapter's requests and their streams.

How a synchronous `step()` drives SGLang: each request is one `async_generate(input_ids=…,
return_logprob=True, stream=True)` task on SGLang's loop (runtime.py); `step()` runs the loop
until a chunk arrives or `poll_s` passes and returns what arrived as TokenEvents. Decoding
never waits for `step()`: SGLang's scheduler process runs on, and between steps its outputs
queue in SGLang's sockets.

A request may span several submissions (a weight update restarts it under the new version):
each submission's input is the request's tokens so far, its outputs continue the request's
token indices, and every token it yields is tagged with the submission's version.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Mapping

from cells.engine.records import TokenEvent, TokenRecord
from cells.engine.sglang import backend as sb
from cells.engine.sglang.requests import RequestState
from cells.engine.sglang.runtime import SGLangRuntime


class RequestStreams:
    """Submits requests to SGLang, collects their chunks, delivers them as TokenEvents."""

    def __init__(self, runtime: SGLangRuntime, poll_s: float) -> None:
        self.runtime = runtime
        self.poll_s = poll_s
        self.reqs: dict[str, RequestState] = {}
        """Requests on this cell (submitted, not yet finished and delivered)."""
        self.pending: list[tuple[RequestState, TokenEvent]] = []
        """Tokens that arrived and are not yet returned by `step()`."""
        self._rids = itertools.count()
        self.kv_store_moves: Counter[str] = Counter()
        """`kv_store` moves by what SGLang reported on resubmission: `hit` (`cached_tokens` > 0)
        or `miss` (everything recomputed; same tokens, only slower)."""
        self.kv_store_cached_tokens = 0
        """Prompt tokens SGLang found cached for `kv_store` moves, in all."""
        self.version_tag_mismatches = 0
        """Tokens whose version SGLang's own spans contradict (must stay 0)."""
        self.ended_without_token: list[tuple[str, str]] = []
        """(request id, reason) of requests SGLang ended before yielding another token."""

    def has_work(self) -> bool:
        # list(): the agent's sync thread asks without the engine lock
        return bool(self.pending) or any(not r.done for r in list(self.reqs.values()))

    def submit(self, req: RequestState, version: int) -> None:
        """(Re)submit `req` to SGLang from its delivered and seen tokens, under `version`."""
        req.input_ids = req.next_input()
        req.seen_ids = []
        req.sgl_rid = sb.submission_rid(req.request_id, next(self._rids))
        req.version = version
        req.submitted = True
        self.reqs[req.request_id] = req
        self.runtime.spawn(self._consume(req, req.sgl_rid))

    def restart_all(self, version: int) -> None:
        """Resubmit every request in flight under `version` (after a weight update)."""
        for req in list(self.reqs.values()):
            if req.submitted and not req.done:
                old, req.sgl_rid = req.sgl_rid, ""  # the old submission's chunks (its abort echo) are ignored
                self.runtime.abort(old)
                self.submit(req, version)

    def abort(self, request_id: str) -> None:
        req = self.reqs.pop(request_id, None)
        if req is not None:
            self._drop(req)

    def step(self) -> list[TokenEvent]:
        if not self.pending and any(r.submitted and not r.done for r in self.reqs.values()):
            self.runtime.ready.clear()
            self.runtime.run(self.runtime.wait_ready(self.poll_s))
        else:
            self.runtime.run(asyncio.sleep(0))  # collectors take what arrived meanwhile
        return self._deliver()

    # -- on SGLang's loop -------------------------------------------------------------------
    async def _consume(self, req: RequestState, rid: str) -> None:
        remaining = req.max_tokens - (len(req.input_ids) - req.prompt_len)
        assert remaining >= 1, "a finished request is never submitted"
        try:
            stream = await self.runtime.generate(
                input_ids=list(req.input_ids), rid=rid, cache_salt=sb.cache_salt(req.version),
                sampling_params=sb.to_sglang_sampling(req.params, req.request_id, remaining))
            async for chunk in stream:
                if req.sgl_rid == rid and not req.dropped:
                    self.on_chunk(req, chunk)
        except Exception as e:  # SGLang refused or failed the request: it ends here
            if req.sgl_rid == rid and not req.dropped and not req.done:
                self._end_without_token(req, f"SGLang error: {e}")

    def on_chunk(self, req: RequestState, chunk: Mapping) -> None:
        meta = chunk["meta_info"]
        if req.moved_by == "kv_store":  # the first chunk of the move's submission: did the store serve?
            req.moved_by = None
            cached = sb.cached_tokens(meta) or 0
            self.kv_store_moves["hit" if cached > 0 else "miss"] += 1
            self.kv_store_cached_tokens += cached
        pairs = sb.new_tokens(chunk, len(req.seen_ids))
        reason = sb.finish_reason(meta)
        truncated = sb.is_truncated(req.params)
        base = req.num_generated_seen
        for j, (tok, lp) in enumerate(pairs):
            event = TokenEvent(req.request_id, base + j, TokenRecord(tok, lp, req.version, truncated),
                               reason if j == len(pairs) - 1 else None)
            self.pending.append((req, event))
        req.seen_ids.extend(tok for tok, _ in pairs)
        if reason is not None:
            self._finish(req, meta, reason, bool(pairs))
        self.runtime.ready.set()

    def _finish(self, req: RequestState, meta: Mapping, reason: str, had_tokens: bool) -> None:
        req.done = True
        spans = sb.span_versions(meta)
        if spans:
            self.version_tag_mismatches += sum(
                max(0, min(e, len(req.seen_ids)) - s) for s, e, v in spans if v != req.version)
        if not had_tokens:  # the end came after the last token: put it on that token if undelivered
            last = next((e for r, e in reversed(self.pending) if r is req), None)
            if last is not None:
                last.finish_reason = reason
            else:
                self._end_without_token(req, str(meta.get("finish_reason")))

    def _end_without_token(self, req: RequestState, reason: str) -> None:
        req.done = True
        self.ended_without_token.append((req.request_id, reason))
        if not any(r is req for r, _ in self.pending) and self.reqs.get(req.request_id) is req:
            del self.reqs[req.request_id]
        self.runtime.ready.set()

    # -- delivery ---------------------------------------------------------------------------
    def _deliver(self) -> list[TokenEvent]:
        pending, self.pending = self.pending, []
        out = []
        for req, event in pending:
            if req.dropped or self.reqs.get(req.request_id) is not req:
                continue
            req.token_ids.append(event.record.token_id)
            req.records.append(event.record)
            out.append(event)
            if event.finish_reason is not None:
                del self.reqs[req.request_id]
        for rid, req in list(self.reqs.items()):  # ended by an error after its last token
            if req.done and req.submitted:
                del self.reqs[rid]
        return out

    def _drop(self, req: RequestState) -> None:
        req.dropped = True
        self.pending = [(r, e) for r, e in self.pending if r is not req]
        if req.submitted and not req.done:
            self.runtime.abort(req.sgl_rid)

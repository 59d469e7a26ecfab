"""Streamed chat completions: one SSE chunk per sampled token, then the parsed message.

Each sampled token is sent as soon as it is recorded; the parsed content and tool calls
follow in one delta once the completion is complete (the parser needs the whole completion
to tell text from tool-call markup). A backend failure after the first token ends the
stream with an error event; the tokens already sent stay recorded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from scheduler.api.jsontext import dumps
from scheduler.gateway.responses import token_logprob_entries, usage
from scheduler.gateway.tito.backend import BackendError
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest, error_body
from scheduler.gateway.tito.tito import TitoGateway, TurnRun
from scheduler.gateway.tito.turn import TurnResult

__all__ = ["start_stream", "sse"]

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Chunks:
    """The ``chat.completion.chunk`` events of one streamed completion."""

    def __init__(
        self, tok: Any, req: ChatCompletionRequest, run: TurnRun, ident: tuple[str, int, str]
    ) -> None:
        cid, created, model = ident
        self.tok, self.req, self.run = tok, req, run
        self.head = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        # the segment the prompt went to; the closing events carry the committed one
        self.tail = {"session_id": run.plan.session_id, "segment": run.segment, "turn": run.plan.turn}
        self.first = True

    def _event(self, choices: list[dict[str, Any]], tail: dict[str, Any], **extra: Any) -> bytes:
        return sse({**self.head, "choices": choices, **extra, **tail})

    def token(self, t: Any) -> bytes:
        """The chunk of one sampled token (the first also opens the assistant message)."""
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if self.first else {}
        self.first = False
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "finish_reason": None,
            "logprobs": {
                "content": token_logprob_entries(self.tok, [t.token_id], [t.logprob]),
                "refusal": None,
            }
            if self.req.logprobs
            else None,
            "token_ids": [t.token_id],
            "token_logprobs": [t.logprob],
            "token_versions": [t.version],
        }
        return self._event([choice], self.tail)

    def closing(self, r: TurnResult) -> Iterator[bytes]:
        """The parsed message's delta, the finish reason and (if asked for) the usage."""
        empty = {"token_ids": [], "token_logprobs": [], "token_versions": []}
        tail = {"session_id": self.run.plan.session_id, "segment": r.segment, "turn": r.turn}
        m = r.message
        delta: dict[str, Any] = {"role": "assistant"} if self.first else {}
        if m.get("content"):
            delta["content"] = m["content"]
        if m.get("reasoning_content"):
            delta["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(m["tool_calls"])]
        if delta:
            choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None, **empty}
            yield self._event([choice], tail)
        choice = {
            "index": 0,
            "delta": {},
            "finish_reason": r.finish_reason,
            "logprobs": None,
            **empty,
        }
        yield self._event([choice], tail)
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._event([], tail, usage=usage(r))


async def stream_body(
    chunks: _Chunks, run: TurnRun, agen: AsyncIterator[Any], first_tok: Any
) -> AsyncIterator[bytes]:
    """The events of a started turn whose first token (or None) was already taken."""
    try:
        if first_tok is not None:
            yield chunks.token(first_tok)
            async for t in agen:
                yield chunks.token(t)
    except BackendError as e:  # failed mid-stream: the tokens sent so far stay recorded
        yield sse(error_body(e.status, str(e) or e.code, code=e.code))
        yield DONE
        return
    assert run.result is not None
    for event in chunks.closing(run.result):
        yield event
    yield DONE


class _GuardedStream(StreamingResponse):
    """A streaming response that runs ``on_close`` once it is over, even if never iterated."""

    def __init__(self, content: Any, *, on_close: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def start_stream(
    gw: TitoGateway,
    sid: str,
    req: ChatCompletionRequest,
    hdrs: dict[str, str],
    ident: Any,
) -> Response:
    """Plan and start the turn before answering, so that refusals (4xx, 429) keep their
    status; the session lock is then held until the response is over, however it ends.

    ``ident(req)`` gives the completion's ``(id, created, model)``."""
    lock = gw.session_lock(sid)
    await lock.__aenter__()
    agen: Any = None
    done = False

    async def release() -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            if agen is not None:
                await agen.aclose()
        finally:
            await lock.__aexit__(None, None, None)

    try:
        plan = await gw.plan(sid, req)
        chunks_ident = ident(req)
        run = gw.start(plan)
        agen = run.tokens()
        try:
            first_tok = await agen.__anext__()
        except StopAsyncIteration:
            first_tok = None
    except BaseException:
        await release()
        raise
    return _GuardedStream(
        stream_body(_Chunks(gw.tokenizer, req, run, chunks_ident), run, agen, first_tok),
        on_close=release,
        media_type="text/event-stream",
        headers={**hdrs, "Cache-Control": "no-cache"},
    )

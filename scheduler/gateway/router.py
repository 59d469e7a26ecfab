"""FastAPI router of the TITO gateway: ``POST /v1/chat/completions`` (+ session finish).

Mount it in the application::

    from scheduler.gateway import make_chat_router
    app.include_router(make_chat_router(backend, "qwen3", registry=metrics_registry))

``X-Session-Id`` groups a harness's requests into one rollout (one session); without it each
request is a one-turn session with a fresh id. The response always echoes ``X-Session-Id``.
Every choice carries ``token_ids`` / ``token_logprobs`` / ``token_versions``; with
``stream: true`` each sampled token is sent as soon as it is recorded, in its own chunk, and
the parsed content and tool calls follow in one delta once the completion is complete (the
parser needs the whole completion to tell text from tool-call markup).

Status codes: 413 body over ``max_body_bytes``; 422 body that is not JSON or does not match
the schema; 400 a well-formed request the gateway refuses (unknown tool-call id, non-text
content, ``n`` > 1, unknown tool in ``tool_choice``, invalid ``X-Session-Id``, messages the
template cannot render); 409 a finished session; 404 finishing an unknown session; 429 (with
``Retry-After``) no capacity; 503 backend failure. All carry an OpenAI error object, streams
included (a refused stream gets the status, not an event). None of the 4xx refusals records
anything; a 429/503 may leave the turn's prompt tokens recorded (loss mask 0), and the retry
of the same request reuses them. A backend failure after the first streamed token ends the
stream with an error event; the tokens already sent stay recorded.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from scheduler.gateway.backend import (
    BackendError,
    CompletionBackend,
    GatewayCounters,
    PrometheusCounters,
    SessionFinished,
    SessionNotFound,
)
from scheduler.gateway.config import DEFAULT_MAX_PROMPT_TOKENS
from scheduler.gateway.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorResponse,
    FinishRequest,
    error_body,
)
from scheduler.gateway.render import ChatRenderer, load_renderer
from scheduler.gateway.tito import GatewayError, TitoGateway, TurnPlan, TurnRun
from scheduler.jsontext import MAX_DEPTH, depth, lone_surrogate_path

__all__ = ["make_chat_router", "SESSION_HEADER"]

SESSION_HEADER = "X-Session-Id"
_SESSION_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _err(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param=param, code=code), status_code=status, headers=headers
    )


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _loc(loc: tuple) -> str:
    """A pydantic error location as an OpenAI ``param`` (``messages[2].content``)."""
    out = ""
    prev: object = None
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif (isinstance(prev, int) and p in _ROLES) or p in (
            "str",
            "function-after[_stop(), union[str,list[str],none]]",
        ):
            pass  # discriminator tag or union branch, not a field
        elif isinstance(p, str) and (
            p.startswith(("list[", "dict[", "union[", "function-"))
            or p in {"TextPart", "OtherPart"}
        ):
            pass
        else:
            out += ("." if out else "") + str(p)
        prev = p
    return out


async def _read_body(request: Request, limit: int) -> bytes | JSONResponse:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                return _err(413, f"request body over {limit} bytes", code="body_too_large")
        except ValueError:
            return _err(400, "invalid Content-Length header", code="invalid_header")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _err(413, f"request body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _token_logprob_entries(tok: Any, ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(ids, lps, strict=False):
        b = tok.token_bytes(t)
        out.append(
            {
                "token": b.decode("utf-8", errors="replace"),
                "logprob": lp,
                "bytes": list(b),
                "top_logprobs": [],
            }
        )
    return out


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


def make_chat_router(
    backend: CompletionBackend,
    tokenizer_name: str = "qwen3",
    *,
    renderer: ChatRenderer | None = None,
    counters: GatewayCounters | None = None,
    registry: Any = None,
    model_name: str | None = None,
    max_body_bytes: int = 8 << 20,
    default_max_tokens: int | None = None,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    use_bridge: bool = True,
    finish_route: bool = True,
) -> APIRouter:
    """Build the gateway router.

    ``tokenizer_name`` selects a renderer preset (``qwen3``, ``qwen3-nothink``,
    ``deepseek-v3``; see :mod:`scheduler.gateway.render`), or pass ``renderer``. Counters:
    ``counters`` if given, else Prometheus counters registered in ``registry`` when one is
    given, else plain in-process counters. ``finish_route=False`` leaves
    ``POST /v1/sessions/{id}/finish`` to the application. The router's ``gateway`` attribute
    is the :class:`TitoGateway` (stats, counters).
    """
    rend = renderer or load_renderer(tokenizer_name)
    if counters is None and registry is not None:
        counters = PrometheusCounters(registry)
    gw = TitoGateway(
        backend,
        rend,
        counters,
        use_bridge=use_bridge,
        default_max_tokens=default_max_tokens,
        max_prompt_tokens=max_prompt_tokens,
    )
    served = model_name or rend.name
    tok = rend.tokenizer
    router = APIRouter()
    router.gateway = gw  # type: ignore[attr-defined]

    def ident(plan: TurnPlan, req: ChatCompletionRequest) -> tuple[str, int, str]:
        return f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or served

    def completion_body(
        run: TurnRun, req: ChatCompletionRequest, cid: str, created: int, model: str
    ) -> dict[str, Any]:
        r = run.result
        assert r is not None
        choice: dict[str, Any] = {
            "index": 0,
            "message": r.message,
            "finish_reason": r.finish_reason,
            "logprobs": {
                "content": _token_logprob_entries(tok, r.completion_ids, r.logprobs),
                "refusal": None,
            }
            if req.logprobs
            else None,
            "token_ids": r.completion_ids,
            "token_logprobs": r.logprobs,
            "token_versions": r.versions,
        }
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": {
                "prompt_tokens": r.prompt_len,
                "completion_tokens": len(r.completion_ids),
                "total_tokens": r.prompt_len + len(r.completion_ids),
            },
            "session_id": r.session_id,
            "segment": r.segment,
            "turn": r.turn,
        }

    def sse(obj: dict[str, Any]) -> bytes:
        return (
            b"data: "
            + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n"
        )

    async def stream_body(
        req: ChatCompletionRequest,
        run: TurnRun,
        agen: AsyncIterator[Any],
        first_tok: Any,
        cid: str,
        created: int,
        model: str,
    ) -> AsyncIterator[bytes]:
        sid = run.plan.session_id
        head = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        empty = {"token_ids": [], "token_logprobs": [], "token_versions": []}
        tail = {"session_id": sid, "segment": run.segment, "turn": run.plan.turn}
        first = True

        def token_chunk(t: Any) -> bytes:
            nonlocal first
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            first = False
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "finish_reason": None,
                "logprobs": {
                    "content": _token_logprob_entries(tok, [t.token_id], [t.logprob]),
                    "refusal": None,
                }
                if req.logprobs
                else None,
                "token_ids": [t.token_id],
                "token_logprobs": [t.logprob],
                "token_versions": [t.version],
            }
            return sse({**head, "choices": [choice], **tail})

        try:
            if first_tok is not None:
                yield token_chunk(first_tok)
                async for t in agen:
                    yield token_chunk(t)
        except BackendError as e:  # failed mid-stream: the tokens sent so far stay recorded
            yield sse(error_body(e.status, str(e) or e.code, code=e.code))
            yield b"data: [DONE]\n\n"
            return
        r = run.result
        assert r is not None
        tail = {"session_id": sid, "segment": r.segment, "turn": r.turn}
        m = r.message
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if m.get("content"):
            delta["content"] = m["content"]
        if m.get("reasoning_content"):
            delta["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(m["tool_calls"])]
        if delta:
            choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None, **empty}
            yield sse({**head, "choices": [choice], **tail})
        choice = {
            "index": 0,
            "delta": {},
            "finish_reason": r.finish_reason,
            "logprobs": None,
            **empty,
        }
        yield sse({**head, "choices": [choice], **tail})
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = {
                "prompt_tokens": r.prompt_len,
                "completion_tokens": len(r.completion_ids),
                "total_tokens": r.prompt_len + len(r.completion_ids),
            }
            yield sse({**head, "choices": [], "usage": usage, **tail})
        yield b"data: [DONE]\n\n"

    async def start_stream(sid: str, req: ChatCompletionRequest, hdrs: dict[str, str]) -> Response:
        """Plan and start the turn before answering, so that refusals (4xx, 429) keep their
        status; the session lock is then held until the response is over, however it ends."""
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
            cid, created, model = ident(plan, req)
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
            stream_body(req, run, agen, first_tok, cid, created, model),
            on_close=release,
            media_type="text/event-stream",
            headers={**hdrs, "Cache-Control": "no-cache"},
        )

    request_schema = ChatCompletionRequest.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    request_schema.pop("$defs", None)

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses={
            400: {"model": ErrorResponse},
            401: {"model": ErrorResponse},
            409: {"model": ErrorResponse},
            413: {"model": ErrorResponse},
            422: {"model": ErrorResponse},
            429: {"model": ErrorResponse},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": request_schema}},
            },
            "parameters": [
                {
                    "name": SESSION_HEADER,
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                }
            ],
        },
        summary="OpenAI-compatible chat completion recorded token-in/token-out",
    )
    async def chat_completions(request: Request) -> Response:
        body = await _read_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            sid = f"sess-{uuid.uuid4().hex}"
        elif not _SESSION_RE.match(sid):
            return _err(
                400,
                f"invalid {SESSION_HEADER} (1-128 of A-Z a-z 0-9 . _ : -)",
                param=SESSION_HEADER,
                code="invalid_session_id",
            )
        hdrs = {SESSION_HEADER: sid}
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return _err(422, "request body is not valid JSON", code="invalid_json", headers=hdrs)
        if not isinstance(data, dict):
            return _err(
                422, "request body must be a JSON object", code="invalid_body", headers=hdrs
            )
        if (where := lone_surrogate_path(data)) is not None:
            return _err(400, f"{where}: a lone UTF-16 surrogate is not text", param=where,
                        code="invalid_text", headers=hdrs)
        if depth(data) > MAX_DEPTH:
            return _err(400, f"request nested deeper than {MAX_DEPTH} levels", code="too_deep",
                        headers=hdrs)
        try:
            req = ChatCompletionRequest.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = _loc(tuple(first.get("loc", ()))) or None
            return _err(
                422,
                f"{param or 'body'}: {first.get('msg')}",
                param=param,
                code="invalid_value",
                headers=hdrs,
            )
        try:
            if req.stream:
                return await start_stream(sid, req, hdrs)
            async with gw.session_lock(sid):
                plan = await gw.plan(sid, req)
                cid, created, model = ident(plan, req)
                run = gw.start(plan)
                await run.run()
            return JSONResponse(completion_body(run, req, cid, created, model), headers=hdrs)
        except GatewayError as e:
            return _err(e.status, e.message, param=e.param, code=e.code, headers=hdrs)
        except BackendError as e:
            h = dict(hdrs)
            ra = getattr(e, "retry_after", None)
            if ra is not None:
                h["Retry-After"] = str(max(1, int(round(ra))))
            return _err(e.status, str(e) or e.code, code=e.code, headers=h)

    if finish_route:

        @router.post(
            "/v1/sessions/{session_id}/finish",
            responses={
                401: {"model": ErrorResponse},
                404: {"model": ErrorResponse},
                409: {"model": ErrorResponse},
                422: {"model": ErrorResponse},
            },
            summary="Close a session into a trajectory",
        )
        async def finish_session(session_id: str, request: Request) -> Response:
            body = await _read_body(request, max_body_bytes)
            if isinstance(body, Response):
                return body
            try:
                data = json.loads(body) if body.strip() else {}
                fin = FinishRequest.model_validate(data)
            except (ValueError, ValidationError) as e:
                return _err(422, f"invalid finish body: {e}".splitlines()[0], code="invalid_body")
            try:
                async with gw.session_lock(session_id):
                    out = await backend.finish_session(session_id, fin.reward, fin.group_id)
            except (SessionNotFound, SessionFinished) as e:
                return _err(e.status, str(e), param="session_id", code=e.code)
            except BackendError as e:
                return _err(e.status, str(e) or e.code, code=e.code)
            finally:
                gw.forget(session_id)
            return JSONResponse(out)

    return router

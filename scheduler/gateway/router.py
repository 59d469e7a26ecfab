"""FastAPI router of the TITO gateway: ``POST /v1/chat/completions`` (+ session finish).

Mount it in the application::

    from scheduler.gateway.router import make_chat_router
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

The request side is :mod:`~scheduler.gateway.intake`, the response bodies
:mod:`~scheduler.gateway.responses`, the event stream :mod:`~scheduler.gateway.streaming`;
this module only wires them to the routes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from scheduler.api.ids import SESSION_ID_PATTERN, SESSION_ID_RULE
from scheduler.api.jsontext import SafeJSONResponse
from scheduler.contract.config.gateway import DEFAULT_MAX_PROMPT_TOKENS
from scheduler.gateway import recording
from scheduler.gateway.intake import SESSION_HEADER, parse_chat_request, read_body, session_id
from scheduler.gateway.responses import backend_error_response, completion_body, error_response
from scheduler.gateway.streaming import start_stream
from scheduler.gateway.tito.backend import (
    BackendError,
    CompletionBackend,
    GatewayCounters,
    PrometheusCounters,
    SessionFinished,
    SessionNotFound,
)
from scheduler.gateway.tito.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorResponse,
    FinishRequest,
)
from scheduler.gateway.tito.render import ChatRenderer, load_renderer
from scheduler.gateway.tito.tito import GatewayError, TitoGateway

__all__ = ["make_chat_router", "SESSION_HEADER"]

PARSE_ON_LOOP_BYTES = 64 << 10
"""Bodies up to this are parsed on the event loop; larger ones on a worker thread."""

_CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 409, 413, 422, 429)
}
_FINISH_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (401, 403, 404, 409, 422)
}


def _chat_openapi() -> dict[str, Any]:
    """The chat route's request body (the raw body is read by hand) and session header."""
    schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "parameters": [
            {"name": SESSION_HEADER, "in": "header", "required": False,
             "schema": {"type": "string", "pattern": SESSION_ID_PATTERN},
             "description": f"The session ({SESSION_ID_RULE}); a new one when absent"}
        ],
    }


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
    route_model: Any = None,
) -> APIRouter:
    """Build the gateway router.

    ``tokenizer_name`` selects a renderer preset (``qwen3``, ``qwen3-nothink``,
    ``deepseek-v3``; see :mod:`scheduler.gateway.tito.render`), or pass ``renderer``. Counters:
    ``counters`` if given, else Prometheus counters registered in ``registry`` when one is
    given, else plain in-process counters. ``finish_route=False`` leaves
    ``POST /v1/sessions/{id}/finish`` to the application. The router's ``gateway`` attribute
    is the :class:`TitoGateway` (stats, counters). ``route_model(model)``, when given, is
    called with each turn's ``model`` field before anything else (the control plane routes a
    turn to the RL job it names; its ``BackendError`` is the answer).
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
    router = APIRouter()
    router.gateway = gw  # type: ignore[attr-defined]
    router.body_bound = None  # type: ignore[attr-defined]
    """Most bytes a chat body holding a prompt the model takes can have, once a long body made
    the route compute it (computing it walks the vocabulary: never on the loop): the body
    decoder then refuses a longer one by its declared length, unread."""

    def ident(req: ChatCompletionRequest) -> tuple[str, int, str]:
        return f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or served

    _add_chat_route(router, gw, ident, max_body_bytes, route_model)
    if finish_route:
        _add_finish_route(router, gw, max_body_bytes)
    return router


def _add_chat_route(router: APIRouter, gw: TitoGateway, ident: Any, max_body_bytes: int, route_model: Any) -> None:
    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses=_CHAT_RESPONSES,
        openapi_extra=_chat_openapi(),
        summary="OpenAI-compatible chat completion recorded token-in/token-out",
    )
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        sid = session_id(request)
        if isinstance(sid, Response):
            return sid
        hdrs = {SESSION_HEADER: sid}
        if len(body) > PARSE_ON_LOOP_BYTES:
            # no prompt within the limit needs a body this long (JSON escapes beyond that are not
            # worth parsing 8 MB for): refused unparsed; else parsed on a worker thread, the
            # event loop serving everyone else meanwhile
            bound = await asyncio.to_thread(gw.planner.byte_bound)
            router.body_bound = None if bound is None else bound + PARSE_ON_LOOP_BYTES  # type: ignore[attr-defined]
            if bound is not None and len(body) > bound + PARSE_ON_LOOP_BYTES:
                return error_response(413, f"a {len(body)}-byte body cannot hold a prompt the model takes "
                                           f"({bound} bytes of text at most)", code="body_too_large", headers=hdrs)
            req = await asyncio.to_thread(parse_chat_request, body, hdrs)
        else:
            req = parse_chat_request(body, hdrs)
        if isinstance(req, Response):
            return req
        if route_model is not None:
            try:
                route_model(req.model)
            except BackendError as e:
                return backend_error_response(e, hdrs)
        return await _serve_chat(gw, sid, req, hdrs, ident)


def _add_finish_route(router: APIRouter, gw: TitoGateway, max_body_bytes: int) -> None:
    @router.post(
        "/v1/sessions/{session_id}/finish",
        responses=_FINISH_RESPONSES,
        summary="Close a session into a trajectory",
    )
    async def finish_session(session_id: str, request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        return await _finish(gw, session_id, body)


async def _serve_chat(
    gw: TitoGateway, sid: str, req: ChatCompletionRequest, hdrs: dict[str, str], ident: Any
) -> Response:
    """One turn: a stream, or the whole completion under the session lock."""
    recording.sending(req)  # the backend records the messages beside the turn's request
    try:
        if req.stream:
            return await start_stream(gw, sid, req, hdrs, ident)
        async with gw.session_lock(sid):
            plan = await gw.plan(sid, req)
            cid, created, model = ident(req)
            run = gw.start(plan)
            result = await run.run()
        return SafeJSONResponse(
            completion_body(gw.tokenizer, result, req, cid, created, model), headers=hdrs
        )
    except GatewayError as e:
        return error_response(e.status, e.message, param=e.param, code=e.code, headers=hdrs)
    except BackendError as e:
        return backend_error_response(e, hdrs)


async def _finish(gw: TitoGateway, session_id: str, body: bytes) -> Response:
    """Close the session into a trajectory (reward, group) and forget its lock."""
    try:
        data = json.loads(body) if body.strip() else {}
        fin = FinishRequest.model_validate(data)
    except (ValueError, ValidationError) as e:
        return error_response(422, f"invalid finish body: {e}".splitlines()[0], code="invalid_body")
    try:
        async with gw.session_lock(session_id):
            out = await gw.backend.finish_session(session_id, fin.reward, fin.group_id)
    except (SessionNotFound, SessionFinished) as e:
        return error_response(e.status, str(e), param="session_id", code=e.code)
    except BackendError as e:
        return error_response(e.status, str(e) or e.code, code=e.code)
    finally:
        gw.forget(session_id)
    return SafeJSONResponse(out)

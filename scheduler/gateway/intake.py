"""A chat request's HTTP body in: size limit, session id, JSON, schema.

Each function returns what it read or the error response to send; nothing is recorded.
"""

from __future__ import annotations

import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from scheduler.api.ids import SESSION_ID_RE, SESSION_ID_RULE
from scheduler.api.jsontext import MAX_DEPTH, depth, lone_surrogate_path
from scheduler.gateway.responses import error_response
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest

__all__ = ["SESSION_HEADER", "parse_chat_request", "read_body", "session_id"]

SESSION_HEADER = "X-Session-Id"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


async def read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or 413 once it passes ``limit`` bytes (by header or as it streams)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                return error_response(413, f"request body over {limit} bytes", code="body_too_large")
        except ValueError:
            return error_response(400, "invalid Content-Length header", code="invalid_header")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return error_response(413, f"request body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def session_id(request: Request) -> str | JSONResponse:
    """The request's ``X-Session-Id``, a fresh one if absent, or 400 if malformed."""
    sid = request.headers.get(SESSION_HEADER)
    if sid is None:
        return f"sess-{uuid.uuid4().hex}"
    if not SESSION_ID_RE.match(sid):
        return error_response(
            400,
            f"invalid {SESSION_HEADER} ({SESSION_ID_RULE})",
            param=SESSION_HEADER,
            code="invalid_session_id",
        )
    return sid


def parse_chat_request(body: bytes, hdrs: dict[str, str]) -> ChatCompletionRequest | JSONResponse:
    """The body as a :class:`ChatCompletionRequest`, or the 400/422 that refuses it."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return error_response(422, "request body is not valid JSON", code="invalid_json", headers=hdrs)
    if not isinstance(data, dict):
        return error_response(
            422, "request body must be a JSON object", code="invalid_body", headers=hdrs
        )
    if (where := lone_surrogate_path(data)) is not None:
        return error_response(400, f"{where}: a lone UTF-16 surrogate is not text", param=where,
                              code="invalid_text", headers=hdrs)
    if depth(data) > MAX_DEPTH:
        return error_response(400, f"request nested deeper than {MAX_DEPTH} levels",
                              code="too_deep", headers=hdrs)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _loc(tuple(first.get("loc", ()))) or None
        return error_response(
            422,
            f"{param or 'body'}: {first.get('msg')}",
            param=param,
            code="invalid_value",
            headers=hdrs,
        )


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

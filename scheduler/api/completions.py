"""POST /v1/generate: token ids in, token ids + log-probs + versions out (SSE if stream).

cellflip's own format, under a name apart from OpenAI's `/v1/completions`: every event is
`{"id", "token_ids", "logprobs", "versions", "finish_reason"}` (`finish_reason` null until
the last), then `data: [DONE]`; without `stream`, one object with the same keys plus
`session_id`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.ids import SESSION_ID_PATTERN, SESSION_ID_RULE
from scheduler.api.jsontext import dumps
from scheduler.api.principal import current_agent, current_job
from scheduler.api.schemas import CompletionCreate, errors
from scheduler.contract.errors import Invalid, TooLarge
from scheduler.contract.records import StoredTokens

router = APIRouter(tags=["completions"], route_class=ApiRoute, responses=errors(401, 403))

SessionId = Annotated[str | None, Header(alias="X-Session-Id", pattern=SESSION_ID_PATTERN,
                                        description=f"The session ({SESSION_ID_RULE}); a new one when absent")]
RequestId = Annotated[str | None, Header(alias="X-Request-Id", pattern=SESSION_ID_PATTERN,
                                         description="A replay's own request id (scheduler.store.replay_request_ids)")]


def _chunk(rid: str, rows: StoredTokens) -> dict:
    return {"id": rid, "token_ids": list(rows.token_ids), "logprobs": list(rows.logprobs),
            "versions": list(rows.versions), "finish_reason": None}


_ANSWER = {200: {"description": "The completion (JSON), or with `stream: true` a server-sent event stream: "
                                "one `data:` line per chunk {id, token_ids, logprobs, versions, finish_reason}, "
                                "then `data: [DONE]`",
                 "content": {"application/json": {"schema": {"type": "object"}},
                             "text/event-stream": {"schema": {"type": "string"}}}}}


PARSE_ON_LOOP_BYTES = 64 << 10
"""Bodies up to this are parsed on the event loop; larger ones on a worker thread."""
BYTES_PER_TOKEN = 16
"""Room for one token id in a body (digits, separator, whitespace): a body longer than the
model's context times this plus a margin cannot fit it and is refused before parsing."""


def generate_body_bound(ctl) -> int | None:
    """Most bytes a /v1/generate body within the model's context can have (None: no cell has
    reported the model's limits yet); the body decoder refuses longer ones unread."""
    limits = ctl.trust.limits if ctl is not None else None
    return limits.max_context * BYTES_PER_TOKEN + PARSE_ON_LOOP_BYTES if limits is not None and limits.max_context else None


async def read_completion(request: Request, ctl) -> CompletionCreate:
    """The body, bounded by the model's context (413 before parsing a body no context could
    hold), parsed off the event loop when large; a body that does not match is a 422."""
    raw = await request.body()  # already read (and size-limited) by the body decoder
    bound = generate_body_bound(ctl)
    if bound is not None and len(raw) > bound:
        raise TooLarge(f"a {len(raw)}-byte body cannot hold a prompt of at most {ctl.trust.limits.max_context} tokens")
    try:
        if len(raw) > PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(CompletionCreate.model_validate_json, raw)
        return CompletionCreate.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


@router.post("/v1/generate", response_model=None, responses={**_ANSWER, **errors(404, 409, 413, 422, 429)},
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/CompletionCreate"}}}}})
async def create_completion(request: Request, ctl: Ctl, session_id: SessionId = None,
                            idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
                            request_id: RequestId = None) -> dict | StreamingResponse:
    body = await read_completion(request, ctl)
    if request_id is not None and not ctl.cfg.store.replay_request_ids:
        raise Invalid("X-Request-Id is taken only by a replay's scheduler (scheduler.store.replay_request_ids)",
                      code="request_id_refused")
    # `stream` is how the answer travels, not what is asked: a replay may switch it
    # /v1/generate names no job: the caller's own, else the session's (a new one: `default`)
    job = current_job() or (ctl.jobs.session_job(session_id) if session_id else "default")
    session_id = ctl.jobs.admit_turn(job, session_id, idempotency_key)  # recorded under its job before placing
    req = ctl.submit_completion(session_id, list(body.prompt_ids), body.params(), idempotency_key,
                                agent=current_agent(), request_id=request_id)
    head = {"X-Session-Id": req.session_id, "X-Request-Id": req.id}
    if body.stream:
        return StreamingResponse(_sse(ctl, req.id), media_type="text/event-stream", headers=head)
    out = {"id": req.id, "session_id": req.session_id, "token_ids": [], "logprobs": [], "versions": [],
           "finish_reason": None}
    async for start, rows, cur in ctl.follow_request(req.id, live=False):
        chunk = _chunk(req.id, rows)
        for k in ("token_ids", "logprobs", "versions"):
            out[k][start:] = chunk[k]  # a start below the end: taken-back tokens are dropped
        out["finish_reason"] = cur.reason if cur.state in ("finished", "failed") else None
    return out


async def _sse(ctl, request_id: str) -> AsyncIterator[str]:
    async for _, rows, cur in ctl.follow_request(request_id):
        if rows:
            yield f"data: {dumps(_chunk(request_id, rows))}\n\n"
        if cur.state in ("finished", "failed") and not rows:
            end = {"id": request_id, "token_ids": [], "logprobs": [], "versions": [], "finish_reason": cur.reason}
            yield f"data: {dumps(end)}\n\n"
    yield "data: [DONE]\n\n"

"""The trajectory export's routes (reader scope: they read, and change nothing the trainer or
another reader sees), the trainer's write-back of what training did with each trajectory, and
the retention loop.

    GET  /v1/export/trajectories  one page of finished trajectories past `after` (JSON)
    GET  /v1/export/stream        every finished trajectory past `after`, one JSON line each,
                                  then `{"next": cursor}`; read in pages of at most
                                  `STREAM_PAGE_*`, at most `STREAM_DUTY` of the event loop
    PUT  /v1/export/ack           an exporter holds everything up to `cursor` on disk
    GET  /v1/export/status        newest finish number, acks, retention's settings and deletions
    GET  /v1/export/versions      the weight versions the rows name (for `cellflip export --weights`)
    POST /v1/trajectories/outcomes  (trainer) what training did with each session

Unlike GET /v1/trajectories (the trainer's own read, which moves its cursor and the staleness
counters), nothing here moves any cursor: an exporter keeps its own (docs/EXPORT.md).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from prometheus_client import Counter
from pydantic import Field
from starlette.responses import StreamingResponse

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.jsontext import dumps
from scheduler.api.schemas import _Body, errors
from scheduler.contract.config.store import RetainConfig
from scheduler.contract.errors import Invalid
from scheduler.contract.trajexport import (
    MAX_PAGE_SESSIONS,
    MAX_PAGE_TOKENS,
    MAX_WEIGHT_TOKENS,
    SCHEMA_VERSION,
)

log = logging.getLogger("cellflip.export")

STREAM_PAGE_SESSIONS = 4
"""Sessions one page of the stream reads before the event loop runs again."""
STREAM_PAGE_TOKENS = 1 << 12
"""Tokens one page of the stream reads before the event loop runs again (at least one session)."""
STREAM_DUTY = 0.25
"""Most of the event loop's time one stream takes: after a page that held the loop t seconds,
the stream waits t × (1 / STREAM_DUTY − 1) before the next (the tick and every request run)."""

router = APIRouter(tags=["export"], route_class=ApiRoute, responses=errors(401, 403))

Cursor = Annotated[int, Query(ge=0, lt=1 << 62)]
Job = Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9._:@]+$")]


@router.get("/v1/export/trajectories", responses=errors(422))
async def export_page(ctl: Ctl, after: Cursor = 0, limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SESSIONS)] = 64,
                      max_tokens: Annotated[int, Query(ge=1, le=MAX_PAGE_TOKENS)] = MAX_PAGE_TOKENS,
                      job: Job = None) -> dict:
    """Finished trajectories with finish number > `after`, oldest first (at most `limit`, and
    no more once `max_tokens` tokens are in); `next` is the cursor to ask from next."""
    items, nxt = ctl.store.export.page(after, limit, max_tokens, job)
    return {"schema_version": SCHEMA_VERSION, "items": items, "next": nxt, "latest": ctl.store.export.latest()}


_NDJSON = {200: {"description": "one JSON object a line, then `{\"next\": cursor}`",
                 "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}}


@router.get("/v1/export/stream", response_class=StreamingResponse, responses={**_NDJSON, **errors(422)})
async def export_stream(ctl: Ctl, after: Cursor = 0, until: Annotated[int | None, Query(ge=0, lt=1 << 62)] = None,
                        job: Job = None, packed: bool = False) -> StreamingResponse:
    """Newline-delimited JSON: one finished trajectory a line past `after` (up to `until`, else
    up to the newest when the stream started), then `{"next": cursor}`. `packed`: per-token
    columns as base64 little-endian arrays under `packed` (docs/EXPORT.md; the exporter's)."""
    stop = ctl.store.export.latest() if until is None else until
    return StreamingResponse(_stream(ctl, after, stop, job, packed), media_type="application/x-ndjson")


async def _stream(ctl: Any, after: int, stop: int, job: str | None, packed: bool) -> AsyncIterator[bytes]:
    cursor = after
    while cursor < stop:
        t0 = time.perf_counter()
        items, nxt = ctl.store.export.page(cursor, STREAM_PAGE_SESSIONS, STREAM_PAGE_TOKENS, job, packed)
        items = [r for r in items if r["finish_seq"] <= stop]
        if nxt == cursor:
            break
        cursor = min(nxt, stop)
        chunk = ("\n".join(dumps(r) for r in items) + "\n").encode() if items else b""
        held = time.perf_counter() - t0
        if chunk:
            yield chunk
        await asyncio.sleep(held * (1 / STREAM_DUTY - 1))  # the tick and every other request run between pages
    yield (dumps({"next": cursor}) + "\n").encode()


class ExportAck(_Body):
    name: str = Field(default="default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")
    """The exporter (one output directory: its manifest's `exporter`)."""
    cursor: int = Field(ge=0, lt=1 << 62)
    """Every finished trajectory up to this finish number is on the exporter's disk."""


@router.put("/v1/export/ack", responses=errors(413, 422))
async def export_ack(body: ExportAck, ctl: Ctl) -> dict:
    """Only retention reads acks (with `require_exported`): a trajectory is deleted once every
    exporter that ever acknowledged holds it."""
    return {"name": body.name, "cursor": ctl.store.retention.ack(body.name, body.cursor)}


@router.get("/v1/export/status")
async def export_status(ctl: Ctl, request: Request) -> dict:
    retain = request.app.state.retention.cfg
    return {"schema_version": SCHEMA_VERSION, "latest": ctl.store.export.latest(),
            "acks": ctl.store.retention.acks(), "retention": retain.model_dump(),
            "deleted": ctl.store.retention.deleted()}


@router.get("/v1/export/versions")
async def export_versions(ctl: Ctl) -> dict:
    """The weight versions (state, source) and their exports: where a row's versions are."""
    view = ctl.versions_view()
    return {"versions": view.get("versions", [])}


class Outcomes(_Body):
    outcomes: dict[Annotated[str, Field(max_length=128)], dict[str, Any]] = Field(max_length=4096)
    """Per session id: what training did with it (docs/EXPORT.md, `training`)."""


@router.post("/v1/trajectories/outcomes", responses=errors(413, 422))
async def trajectory_outcomes(body: Outcomes, ctl: Ctl) -> dict:
    """The trainer's write-back: the update that trained each session (or why it was dropped),
    its advantage and staleness. Unknown sessions are skipped (counted in the answer)."""
    if not body.outcomes:
        return {"recorded": 0, "unknown": 0}
    for sid, o in body.outcomes.items():
        _check_weights(sid, o.get("weights"))
    n = ctl.store.retention.put_outcomes(body.outcomes)
    return {"recorded": n, "unknown": len(body.outcomes) - n}


def _check_weights(sid: str, text: Any) -> None:
    """An outcome's `weights` are base64 of at most `MAX_WEIGHT_TOKENS` little-endian float32s;
    anything else refuses the whole write-back (422), so nothing of it is recorded."""
    if text is None:
        return
    limit = (MAX_WEIGHT_TOKENS * 4 + 2) // 3 * 4
    if not isinstance(text, str) or len(text) > limit:
        raise Invalid(f"outcomes[{sid!r}].weights: base64 of at most {MAX_WEIGHT_TOKENS} float32 values expected",
                      code="invalid_weights")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise Invalid(f"outcomes[{sid!r}].weights is not base64", code="invalid_weights") from None
    if len(raw) % 4:
        raise Invalid(f"outcomes[{sid!r}].weights: {len(raw)} bytes is not a whole number of float32 values",
                      code="invalid_weights")


class Retention:
    """The retention loop: one bounded pass every `interval_s`, each deletion counted in
    `cellflip_trajectories_deleted_total{reason}` (and the store's `retention_log`)."""

    def __init__(self, cfg: RetainConfig, registry: Any) -> None:
        self.cfg = cfg
        self.deleted = Counter("cellflip_trajectories_deleted", "Finished trajectories deleted by retention.",
                               ["reason"], registry=registry)
        self.deleted_tokens = Counter("cellflip_trajectory_tokens_deleted", "Token rows deleted by retention.",
                                      ["reason"], registry=registry)

    def pass_once(self, store: Any) -> dict[str, dict[str, int]]:
        out = store.retention.purge(self.cfg)
        for reason, d in out.items():
            self.deleted.labels(reason).inc(d["sessions"])
            self.deleted_tokens.labels(reason).inc(d["tokens"])
            log.info("retention deleted %d trajectories (%d tokens): %s", d["sessions"], d["tokens"], reason)
        return out

    async def run(self, store: Any) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.pass_once(store)
            except Exception:  # never takes the scheduler down; the next pass tries again
                log.exception("retention pass failed")

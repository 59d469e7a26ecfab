"""Cell protocol routes (see scheduler.contract.protocol for every message and rule).

Each body is validated once, here, into its typed message (commands and events included): a
malformed one is a 422 with reason `invalid`, before anything is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from scheduler.api.deps import ApiRoute, Ctl, check_int64, check_sync_int64
from scheduler.api.principal import CURRENT
from scheduler.api.schemas import errors
from scheduler.contract.errors import Invalid
from scheduler.contract.protocol import (
    AbortMigrationRequest,
    CommitRequest,
    ProtocolError,
    RegisterRequest,
    SyncRequest,
)

MAX_LISTED_ERRORS = 8


class ProtocolRoute(ApiRoute):
    """A cell message that does not validate is the cell protocol's `invalid` (422)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                found = list(e.errors())
                where = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg', '')}"
                                  for err in found[:MAX_LISTED_ERRORS])
                raise ProtocolError(f"malformed message ({len(found)} errors): {where}") from None

        return route


router = APIRouter(prefix="/internal/v1", tags=["internal"], route_class=ProtocolRoute, responses=errors(401, 403))


@router.post("/cells/register", responses=errors(404, 409, 413, 422))
async def register(body: RegisterRequest, ctl: Ctl) -> dict:
    """A live cell's id cannot be taken over by another incarnation (409 `cell_id_in_use`)
    except by an admin token; a quarantined id registers again only after an admin readmits it.
    A registration into a chosen RL job (`job`): 404 `unknown_job`, 409 `job_draining` or
    `model_mismatch`, before anything is recorded."""
    check_int64(body)
    caller = CURRENT.get()
    return ctl.register(body, admin=caller is None or caller.scope == "admin").to_dict()


_SYNC = TypeAdapter(SyncRequest)
_SYNC_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/SyncRequest"}}}}}


async def read_sync(request: Request) -> SyncRequest:
    """A sync's body parsed and validated in one pass by pydantic's JSON parser (no Python
    list per token record before the columns are built); a body that is not JSON, or not a
    `SyncRequest`, is refused as FastAPI's own parsing refuses it."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        mime = ctype.split(";", 1)[0].strip().lower()
        if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
            raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                           "msg": "Input should be a valid dictionary or object to extract fields from"}])
    raw = await request.body()
    try:
        return _SYNC.validate_json(raw)
    except ValidationError as e:
        found = e.errors(include_url=False, include_input=False)
        if any(err["type"] == "json_invalid" for err in found):
            raise Invalid("request body is not valid JSON text") from None
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in found]) from None


@router.post("/cells/{cell_id}/sync", responses=errors(404, 409, 413, 422), openapi_extra=_SYNC_BODY)
async def sync(cell_id: str, request: Request, ctl: Ctl) -> dict:
    body = await read_sync(request)
    check_sync_int64(body)
    return (await ctl.sync(cell_id, body)).to_dict()


@router.post("/migrations/{migration_id}/commit", responses=errors(404, 409, 413, 422))
async def commit(migration_id: str, body: CommitRequest, ctl: Ctl) -> dict:
    check_int64(body)
    return ctl.commit_migration(migration_id, body).to_dict()


@router.post("/migrations/{migration_id}/abort", responses=errors(404, 409, 413, 422))
async def abort(migration_id: str, body: AbortMigrationRequest, ctl: Ctl) -> dict:
    return ctl.abort_migration(migration_id, body)

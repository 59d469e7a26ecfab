"""GET/POST /v1/versions, DELETE /v1/versions/{v} (retire; 409 while tokens are unscored)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.schemas import VersionCreate, errors

router = APIRouter(prefix="/v1/versions", tags=["versions"], route_class=ApiRoute, responses=errors(401, 403))


@router.get("")
async def list_versions(ctl: Ctl) -> dict:
    return ctl.versions_view()


@router.post("", status_code=201, responses=errors(409, 413, 422))
async def publish_version(body: VersionCreate, ctl: Ctl,
                          idempotency_key: Annotated[str | None, Header(max_length=256)] = None) -> dict:
    return ctl.publish_version(body.version, body.source.model_dump() if body.source else None, idempotency_key)


@router.delete("/{version}", responses=errors(404, 409, 422))
async def retire_version(version: Annotated[int, Path(ge=0, lt=1 << 62)], ctl: Ctl) -> dict:
    return ctl.retire_version(version)

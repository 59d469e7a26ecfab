"""GET/POST /v1/versions, DELETE /v1/versions/{v} (retire; 409 while tokens are unscored),
POST /v1/versions/{v}/exports and GET /v1/exports/{id} (a version written as a Hugging Face
directory by a cell holding it: scheduler/control/exports.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.principal import current_job
from scheduler.api.schemas import ExportCreate, VersionCreate, errors

router = APIRouter(prefix="/v1/versions", tags=["versions"], route_class=ApiRoute, responses=errors(401, 403))


@router.get("")
async def list_versions(ctl: Ctl) -> dict:
    out = ctl.versions_view()
    job = current_job()
    if job is not None and any(j.name != "default" for j in ctl.store.jobs.list()):
        mine = ctl.jobs.versions_of(job)  # a job-bound trainer sees its own job's lineage
        out["versions"] = [v for v in out["versions"] if v["version"] in mine]
    return out


@router.post("", status_code=201, responses=errors(409, 413, 422))
async def publish_version(body: VersionCreate, ctl: Ctl,
                          idempotency_key: Annotated[str | None, Header(max_length=256)] = None) -> dict:
    return ctl.publish_version(body.version, body.source.model_dump() if body.source else None, idempotency_key,
                               current_job() or "default")  # the publishing trainer's job's lineage


@router.delete("/{version}", responses=errors(404, 409, 422))
async def retire_version(version: Annotated[int, Path(ge=0, lt=1 << 62)], ctl: Ctl) -> dict:
    return ctl.retire_version(version)


@router.post("/{version}/exports", status_code=202, responses=errors(404, 409, 422))
async def export_version(version: Annotated[int, Path(ge=0, lt=1 << 62)], body: ExportCreate, ctl: Ctl) -> dict:
    """Ask a verified cell holding `version` to write it as a Hugging Face directory at `path`
    below its `cells.export_root` (409 `version_not_held` when no live cell holds it). Poll
    GET /v1/exports/{id} until `state` is `done` (`written_to`, `bytes`) or `failed` (`reason`)."""
    return ctl.export_version(version, body.path, body.dtype)


exports_router = APIRouter(prefix="/v1/exports", tags=["versions"], route_class=ApiRoute, responses=errors(401, 403))


@exports_router.get("/{export_id}", responses=errors(404))
async def get_export(export_id: Annotated[str, Path(max_length=64)], ctl: Ctl) -> dict:
    return ctl.export_view(export_id)

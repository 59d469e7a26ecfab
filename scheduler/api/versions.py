"""GET/POST /v1/versions, DELETE /v1/versions/{v} (retire; 409 while tokens are unscored)."""

from __future__ import annotations

from fastapi import APIRouter

from scheduler.api.deps import Ctl
from scheduler.api.schemas import VersionCreate

router = APIRouter(prefix="/v1/versions", tags=["versions"])


@router.get("")
async def list_versions(ctl: Ctl) -> dict:
    st = ctl.scoring
    return {"versions": ctl.list_versions(),
            "scoring": {"tokens": st.scored_tokens, "seconds": round(st.scoring_seconds, 6), "tasks": len(st.tasks)}}


@router.post("", status_code=201)
async def publish_version(body: VersionCreate, ctl: Ctl) -> dict:
    return ctl.publish_version(body.version, body.source.model_dump() if body.source else None)


@router.delete("/{version}")
async def retire_version(version: int, ctl: Ctl) -> dict:
    return ctl.retire_version(version)

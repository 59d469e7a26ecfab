"""GET /v1/sessions/{id}, POST /v1/sessions/{id}/finish, GET /v1/trajectories."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from scheduler.api.deps import Ctl
from scheduler.api.schemas import SessionFinish

router = APIRouter(tags=["sessions"])


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, ctl: Ctl) -> dict:
    return ctl.store.sessions.to_api(session_id)


@router.post("/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: SessionFinish, ctl: Ctl) -> dict:
    return ctl.finish_session(session_id, body.reward, body.group_id)


@router.get("/v1/trajectories")
async def trajectories(ctl: Ctl, cursor: Annotated[int, Query(ge=0)] = 0,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 16) -> dict:
    items, nxt = ctl.store.sessions.trajectories(cursor, limit)
    ctl.trajectory_cursor = max(ctl.trajectory_cursor, nxt)
    return {"trajectories": items, "next_cursor": nxt}

"""GET /v1/sessions/{id}, POST /v1/sessions/{id}/finish, GET /v1/trajectories."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.schemas import SessionFinish, errors

router = APIRouter(tags=["sessions"], route_class=ApiRoute, responses=errors(401))


@router.get("/v1/sessions/{session_id}", responses=errors(404))
async def get_session(session_id: str, ctl: Ctl) -> dict:
    return ctl.store.sessions.to_api(session_id)


@router.post("/v1/sessions/{session_id}/finish", responses=errors(404, 409, 413, 422))
async def finish_session(session_id: str, body: SessionFinish, ctl: Ctl) -> dict:
    return ctl.finish_session(session_id, body.reward, body.group_id)


@router.get("/v1/trajectories", responses=errors(422))
async def trajectories(ctl: Ctl, cursor: Annotated[int, Query(ge=0, lt=1 << 63)] = 0,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 16) -> dict:
    items, nxt = ctl.store.sessions.trajectories(cursor, limit)
    ctl.trajectory_cursor = max(ctl.trajectory_cursor, nxt)
    return {"trajectories": items, "next_cursor": nxt}

"""GET /v1/sessions/{id}, POST /v1/sessions/{id}/finish, GET /v1/trajectories (with each
trajectory's staleness, past the bound handled by policy: scheduler/control/staleness.py),
POST /v1/trajectories/dropped (groups the trainer dropped, counted)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from pydantic import Field

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.ids import SESSION_ID_PATTERN, SESSION_ID_RULE
from scheduler.api.principal import current_agent, current_job
from scheduler.api.schemas import SessionFinish, _Body, errors
from scheduler.contract.errors import NotFound
from scheduler.control.metrics import GROUP_DROP_REASONS

SessionPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN, description=SESSION_ID_RULE)]

router = APIRouter(tags=["sessions"], route_class=ApiRoute, responses=errors(401, 403))


def _own_job(ctl, session_id: str) -> None:
    """A job-bound token's sessions are its job's: another job's session is unknown (404)."""
    job = current_job()
    if job is not None and ctl.jobs.session_job(session_id) != job:
        raise NotFound(f"unknown session {session_id!r}")


@router.get("/v1/sessions/{session_id}", responses=errors(404, 429))
async def get_session(session_id: SessionPath, ctl: Ctl) -> dict:
    """An agent token reads its own sessions only (another's answers 404, as an unknown id);
    a job-bound trainer token its job's."""
    _own_job(ctl, session_id)
    return ctl.store.sessions.to_api(session_id, current_agent())


@router.post("/v1/sessions/{session_id}/finish", responses=errors(404, 409, 413, 422))
async def finish_session(session_id: SessionPath, body: SessionFinish, ctl: Ctl) -> dict:
    _own_job(ctl, session_id)
    return ctl.finish_session(session_id, body.reward, body.group_id)


@router.get("/v1/trajectories", responses=errors(422))
async def trajectories(ctl: Ctl, cursor: Annotated[int, Query(ge=0, lt=1 << 63)] = 0,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 16) -> dict:
    """A job-bound trainer token gets its own job's trajectories only, each one's staleness
    counted in its job's lineage (the cursor still walks every finished session)."""
    return ctl.trajectories(cursor, limit, current_job())


class GroupsDropped(_Body):
    reason: Literal[GROUP_DROP_REASONS]  # type: ignore[valid-type]
    """Why the trainer dropped them (cells/trainer/groups.py)."""
    groups: int = Field(ge=0, le=1 << 30)
    """Groups dropped whole."""
    trajectories: int = Field(ge=0, le=1 << 30)
    """Their trajectories."""


@router.post("/v1/trajectories/dropped", responses=errors(413, 422))
async def trajectories_dropped(body: GroupsDropped, ctl: Ctl) -> dict:
    """The trainer dropped groups without training them: counted in
    `cellflip_groups_dropped_total{reason}`, never silent."""
    ctl.metrics.groups_dropped.labels(body.reason).inc(body.groups)
    ctl.metrics.group_trajectories_dropped.labels(body.reason).inc(body.trajectories)
    return {"reason": body.reason, "groups": body.groups, "trajectories": body.trajectories}

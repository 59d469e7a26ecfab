"""POST /v1/jobs (admin: create an RL job), GET /v1/jobs, GET /v1/jobs/{name} (a trainer token
sees its own job only), DELETE /v1/jobs/{name} (admin: drain, then delete), POST
/v1/jobs/{name}/cells (admin: move a cell into the job), PATCH /v1/jobs/{name} (admin: change
its settings). docs/JOBS.md."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import Field

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.principal import current_job
from scheduler.api.schemas import _Body, errors

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=ApiRoute, responses=errors(401, 403))

JobName = Annotated[str, Path(max_length=63)]


class JobCreate(_Body):
    name: str = Field(max_length=63)
    """What clients put in the OpenAI `model` field; lower-case letters, digits, '.', '_', '-'."""
    model: str = Field(min_length=1, max_length=512)
    """A model preset or a Hugging Face path, as cells name theirs, or `fleet` (the fleet's own):
    only cells of that model serve the job (docs/JOBS.md "Models")."""
    min_cells: int = Field(default=0, ge=0, le=1 << 20)
    """Cells the job always holds (when the fleet has them)."""
    max_cells: int | None = Field(default=None, ge=0, le=1 << 20)
    """Most cells it may hold (None: no maximum)."""
    weight: float = Field(default=1.0, gt=0, le=1e6)
    """Its share of the cells above every job's minimum, against the other jobs' weights."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """`objective`, `staleness_bound`, `staleness_policy`, `min_rollout_cells` (the last three:
    the fleet's when absent), `max_sessions` (open sessions admitted), `drain_s`, `seed`, `task`."""


class JobUpdate(_Body):
    settings: dict[str, Any]
    """Settings to change, over the job's own (null: back to the fleet's default)."""


class CellMove(_Body):
    cell: str = Field(min_length=1, max_length=128)
    """The cell to move into the job: drained of its job's live rollouts (they migrate to that
    job's other cells), then loaded, then serving this job."""


@router.post("", status_code=201, responses=errors(409, 413, 422))
async def create_job(body: JobCreate, ctl: Ctl) -> dict:
    return ctl.jobs.create(body.model_dump())


@router.get("")
async def list_jobs(ctl: Ctl) -> dict:
    out = ctl.jobs.list_view()
    mine = current_job()
    if mine is not None:
        out["jobs"] = [j for j in out["jobs"] if j["name"] == mine]
        out["moves"] = [m for m in out["moves"] if mine in (m["from"], m["to"])]
    return out


@router.get("/{name}", responses=errors(404))
async def get_job(name: JobName, ctl: Ctl) -> dict:
    ctl.jobs.check_access(name, current_job())
    return ctl.jobs.view(name)


@router.patch("/{name}", responses=errors(404, 422))
async def update_job(name: JobName, body: JobUpdate, ctl: Ctl) -> dict:
    return ctl.jobs.update(name, body.settings)


@router.delete("/{name}", responses=errors(404, 409))
async def delete_job(name: JobName, ctl: Ctl) -> dict:
    return ctl.jobs.delete(name)


@router.post("/{name}/cells", status_code=202, responses=errors(404, 409, 422))
async def move_cell(name: JobName, body: CellMove, ctl: Ctl) -> dict:
    return ctl.jobs.moves.start(body.cell, name)

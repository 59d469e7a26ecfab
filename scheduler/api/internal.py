"""Cell protocol routes (see scheduler.contract.protocol for every message and rule)."""

from __future__ import annotations

from fastapi import APIRouter

from scheduler.api.deps import ApiRoute, Ctl, check_int64
from scheduler.api.principal import CURRENT
from scheduler.api.schemas import errors
from scheduler.contract.protocol import (
    AbortMigrationRequest,
    CommitRequest,
    RegisterRequest,
    SyncRequest,
)

router = APIRouter(prefix="/internal/v1", tags=["internal"], route_class=ApiRoute, responses=errors(401, 403))


@router.post("/cells/register", responses=errors(409, 413, 422))
async def register(body: RegisterRequest, ctl: Ctl) -> dict:
    """A live cell's id cannot be taken over by another incarnation (409 `cell_id_in_use`)
    except by an admin token; a quarantined id registers again only after an admin readmits it."""
    check_int64(body)
    caller = CURRENT.get()
    return ctl.register(body, admin=caller is None or caller.scope == "admin").to_dict()


@router.post("/cells/{cell_id}/sync", responses=errors(404, 409, 413, 422))
async def sync(cell_id: str, body: SyncRequest, ctl: Ctl) -> dict:
    check_int64(body)
    return (await ctl.sync(cell_id, body)).to_dict()


@router.post("/migrations/{migration_id}/commit", responses=errors(404, 409, 413, 422))
async def commit(migration_id: str, body: CommitRequest, ctl: Ctl) -> dict:
    check_int64(body)
    return ctl.commit_migration(migration_id, body).to_dict()


@router.post("/migrations/{migration_id}/abort", responses=errors(404, 409, 413, 422))
async def abort(migration_id: str, body: AbortMigrationRequest, ctl: Ctl) -> dict:
    return ctl.abort_migration(migration_id, body)

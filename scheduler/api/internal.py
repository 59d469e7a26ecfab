"""Cell protocol routes (see scheduler.protocol for every message and rule)."""

from __future__ import annotations

from fastapi import APIRouter

from scheduler.api.deps import Ctl
from scheduler.protocol import AbortMigrationRequest, CommitRequest, RegisterRequest, SyncRequest

router = APIRouter(prefix="/internal/v1", tags=["internal"])


@router.post("/cells/register")
async def register(body: RegisterRequest, ctl: Ctl) -> dict:
    return ctl.register(body).to_dict()


@router.post("/cells/{cell_id}/sync")
async def sync(cell_id: str, body: SyncRequest, ctl: Ctl) -> dict:
    return (await ctl.sync(cell_id, body)).to_dict()


@router.post("/migrations/{migration_id}/commit")
async def commit(migration_id: str, body: CommitRequest, ctl: Ctl) -> dict:
    return ctl.commit_migration(migration_id, body).to_dict()


@router.post("/migrations/{migration_id}/abort")
async def abort(migration_id: str, body: AbortMigrationRequest, ctl: Ctl) -> dict:
    return ctl.abort_migration(migration_id, body)

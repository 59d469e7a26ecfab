"""GET /v1/cells, GET /v1/cells/{id}."""

from __future__ import annotations

from fastapi import APIRouter

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.schemas import errors
from scheduler.contract.errors import NotFound

router = APIRouter(prefix="/v1/cells", tags=["cells"], route_class=ApiRoute, responses=errors(401))


@router.get("")
async def list_cells(ctl: Ctl) -> dict:
    return {"cells": ctl.cell_view()}


@router.get("/{cell_id}", responses=errors(404))
async def get_cell(cell_id: str, ctl: Ctl) -> dict:
    found = ctl.cell_view(cell_id)
    if not found:
        raise NotFound(f"unknown cell {cell_id!r}")
    return found[0]

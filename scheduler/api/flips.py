"""POST /v1/flips (+ Idempotency-Key), GET /v1/flips, GET /v1/flips/{id}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.principal import current_job
from scheduler.api.schemas import FlipCreate, errors

router = APIRouter(prefix="/v1/flips", tags=["flips"], route_class=ApiRoute, responses=errors(401, 403))


@router.post("", status_code=202, responses=errors(404, 409, 413, 422))
async def create_flip(body: FlipCreate, ctl: Ctl,
                      idempotency_key: Annotated[str | None, Header(max_length=256)] = None) -> dict:
    return ctl.create_flips(body.to, body.cell, body.count, body.expected_generation, idempotency_key, current_job())


@router.get("")
async def list_flips(ctl: Ctl, active: bool = False) -> dict:
    return {"flips": [f.to_api() for f in ctl.store.fleet.list_flips(active_only=active)]}


@router.get("/{flip_id}", responses=errors(404))
async def get_flip(flip_id: str, ctl: Ctl) -> dict:
    return ctl.get_flip(flip_id)

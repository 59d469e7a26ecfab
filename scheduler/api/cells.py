"""GET /v1/cells (paged: `limit`, `cursor`), GET /v1/cells/{id}."""

from __future__ import annotations

from typing import ClassVar

from fastapi import APIRouter

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.jsontext import SafeJSONResponse
from scheduler.api.schemas import errors
from scheduler.contract.errors import CellflipError, NotFound

router = APIRouter(prefix="/v1/cells", tags=["cells"], route_class=ApiRoute, responses=errors(401, 403))

DEFAULT_LIMIT = 1000
"""Cells in a page when `limit` is not given (a small fleet fits in one)."""
MAX_LIMIT = 10_000
MAX_CURSOR = 256


class BadPage(CellflipError):
    """A `limit` or `cursor` the cell list cannot page by."""

    status: ClassVar[int] = 400
    code = "bad_page"


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise BadPage(f"limit must be a whole number from 1 to {MAX_LIMIT}")
    return int(raw)


def _cursor(raw: str | None) -> str | None:
    if raw is not None and (not raw or len(raw) > MAX_CURSOR or not raw.isprintable()):
        raise BadPage(f"cursor must be the next_cursor of a previous page (1 to {MAX_CURSOR} printable characters)")
    return raw


# The answers are plain JSON already (str, numbers, lists, dicts): written straight out, not
# walked again by FastAPI's encoder (most of a small GET's cost at fleet scale).

@router.get("", responses=errors(400), response_model=dict)
async def list_cells(ctl: Ctl, limit: str | None = None, cursor: str | None = None) -> SafeJSONResponse:
    """Cells in id order, `limit` at a time (default 1000, at most 10,000): `next_cursor` is the
    `cursor` of the next page, null after the last."""
    cells, nxt = ctl.cell_page(_cursor(cursor), _limit(limit))
    _with_jobs(ctl, cells)
    return SafeJSONResponse({"cells": cells, "next_cursor": nxt})


def _with_jobs(ctl, cells: list[dict]) -> None:
    """Each cell's RL job (docs/JOBS.md), one read for the page."""
    jobs = ctl.store.jobs.jobs_of("cell", [c["id"] for c in cells])
    for c in cells:
        c["job"] = jobs[c["id"]]


@router.get("/{cell_id}", responses=errors(404), response_model=dict)
async def get_cell(cell_id: str, ctl: Ctl) -> SafeJSONResponse:
    found = ctl.cell_view(cell_id)
    if not found:
        raise NotFound(f"unknown cell {cell_id!r}")
    _with_jobs(ctl, found[:1])
    return SafeJSONResponse(found[0])


@router.post("/{cell_id}/readmit", responses=errors(404, 409), response_model=dict)
async def readmit(cell_id: str, ctl: Ctl) -> dict:
    """Clear a cell's quarantine (admin): its id may register again, unverified until its probe agrees."""
    return ctl.readmit_cell(cell_id)

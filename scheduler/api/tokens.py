"""POST /v1/tokens (create; the token is in the answer, once), GET /v1/tokens, DELETE
/v1/tokens/{id} (revoke, effective from the next request): admin only (scheduler/api/scopes.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request
from pydantic import Field

from scheduler.api.auth import TokenRegistry
from scheduler.api.deps import ApiRoute
from scheduler.api.schemas import _Body, errors
from scheduler.contract.errors import Conflict

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=ApiRoute, responses=errors(401, 403))


class TokenCreate(_Body):
    scope: Literal["admin", "trainer", "cell", "agent", "scrape"]
    name: str = Field(default="", max_length=128, pattern=r"^[\w .:@/-]*$")
    """A label for the operator (who or what holds the token)."""
    job: str | None = Field(default=None, min_length=1, max_length=63)
    """The RL job an agent or trainer token acts on (`default` when left out; docs/JOBS.md)."""


def _registry(request: Request) -> TokenRegistry:
    reg = getattr(request.app.state, "tokens", None)
    if reg is None:
        raise Conflict("auth is off (scheduler.auth: none): there are no tokens to manage", code="auth_off")
    return reg


@router.post("", status_code=201, responses=errors(404, 409, 413, 422))
async def create_token(body: TokenCreate, request: Request) -> dict:
    reg = _registry(request)
    row, token = reg.create(body.scope, body.name, body.job)
    return {**row.to_api(), "job": reg.job_of(row.id), "token": token}


@router.get("", responses=errors(409))
async def list_tokens(request: Request) -> dict:
    reg = _registry(request)
    jobs = reg.jobs_of_tokens()
    return {"tokens": [{**r.to_api(), "job": jobs.get(r.id, "default")} for r in reg.list()]}


@router.delete("/{token_id}", responses=errors(404, 409, 422))
async def revoke_token(token_id: Annotated[str, Path(max_length=64)], request: Request) -> dict:
    return _registry(request).revoke(token_id).to_api()

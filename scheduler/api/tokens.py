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


def _registry(request: Request) -> TokenRegistry:
    reg = getattr(request.app.state, "tokens", None)
    if reg is None:
        raise Conflict("auth is off (scheduler.auth: none): there are no tokens to manage", code="auth_off")
    return reg


@router.post("", status_code=201, responses=errors(409, 413, 422))
async def create_token(body: TokenCreate, request: Request) -> dict:
    row, token = _registry(request).create(body.scope, body.name)
    return {**row.to_api(), "token": token}


@router.get("", responses=errors(409))
async def list_tokens(request: Request) -> dict:
    return {"tokens": [r.to_api() for r in _registry(request).list()]}


@router.delete("/{token_id}", responses=errors(404, 409, 422))
async def revoke_token(token_id: Annotated[str, Path(max_length=64)], request: Request) -> dict:
    return _registry(request).revoke(token_id).to_api()

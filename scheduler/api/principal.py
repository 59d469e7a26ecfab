"""Who is calling: the principal the auth middleware resolved from the bearer token, for the
handlers and the gateway's backend that act on it (an agent token sees only its own sessions).

A context variable, set by the middleware for the whole request (a streamed answer included):
the chat gateway's logic is shared with the toy task and takes no caller argument, so its
backend on the control plane reads the caller here rather than through every signature.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    """The token's id (`GET /v1/tokens`), never the token."""
    scope: str
    name: str

    @property
    def agent(self) -> str | None:
        """The agent token's id when this is an agent, else None (no restriction to own sessions)."""
        return self.id if self.scope == "agent" else None


CURRENT: ContextVar[Principal | None] = ContextVar("cellflip_principal", default=None)
"""The caller of the request being served (None: auth is off, or outside a request)."""


def current_agent() -> str | None:
    """The calling agent token's id, or None when the caller is not an agent."""
    p = CURRENT.get()
    return None if p is None else p.agent

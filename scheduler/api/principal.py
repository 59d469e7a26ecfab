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
    job: str = "default"
    """The RL job an agent or trainer token acts on (scheduler/control/jobs.py); other scopes
    are bound to no job (`bound_job` is None for them)."""

    @property
    def bound_job(self) -> str | None:
        """The only job this caller may act on; None: any job (admin and the other scopes)."""
        return self.job if self.scope in JOB_SCOPES else None

    @property
    def agent(self) -> str | None:
        """The agent token's id when this is an agent, else None (no restriction to own sessions)."""
        return self.id if self.scope == "agent" else None


JOB_SCOPES = frozenset({"agent", "trainer"})
"""Scopes whose tokens belong to one job."""

CURRENT: ContextVar[Principal | None] = ContextVar("cellflip_principal", default=None)
"""The caller of the request being served (None: auth is off, or outside a request)."""


def current_job() -> str | None:
    """The only job the caller may act on (None: admin, another scope, or auth off)."""
    p = CURRENT.get()
    return None if p is None else p.bound_job


def current_agent() -> str | None:
    """The calling agent token's id, or None when the caller is not an agent."""
    p = CURRENT.get()
    return None if p is None else p.agent


ROUTED_JOB: ContextVar[str | None] = ContextVar("cellflip_routed_job", default=None)
"""The RL job the request's turn was routed to (the chat gateway's `model` field; None: not
routed, the caller's own job applies)."""

"""Which token scope each route takes: the one table (scheduler/contract/tokens.py defines the
scopes). The admin scope takes every route. A route missing here is refused to every scope
but admin at run time, and fails `tests/security/test_scopes.py`.

`PUBLIC` routes need no token: the health check, and the API's documentation (the Swagger and
ReDoc pages, their local assets and `/openapi.json`, which describe the API and hold no data),
so that a browser, which cannot send a bearer header, opens `/docs`; Swagger's Authorize button
then carries the token on the calls it makes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.routing import Mount, compile_path

try:  # FastAPI 0.16x keeps included routers as one route each; this yields their routes
    from fastapi.routing import iter_route_contexts
except ImportError:  # older FastAPI copies every included route into the app's list
    iter_route_contexts = None  # type: ignore[assignment]

PUBLIC: frozenset[str] = frozenset({"public"})
TRAINER = frozenset({"trainer"})
AGENT = frozenset({"agent"})
CELL = frozenset({"cell"})
SCRAPE = frozenset({"scrape"})
ADMIN = frozenset({"admin"})
READER = frozenset({"reader"})

ROUTE_SCOPES: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("MOUNT", "/docs-assets"): PUBLIC,
    ("GET", "/metrics"): SCRAPE,
    # the trainer's API
    ("GET", "/v1/cells"): TRAINER,
    ("GET", "/v1/cells/{cell_id}"): TRAINER,
    ("POST", "/v1/cells/{cell_id}/readmit"): ADMIN,
    ("POST", "/v1/flips"): TRAINER,
    ("GET", "/v1/flips"): TRAINER,
    ("GET", "/v1/flips/{flip_id}"): TRAINER,
    ("GET", "/v1/versions"): TRAINER,
    ("POST", "/v1/versions"): TRAINER,
    ("DELETE", "/v1/versions/{version}"): TRAINER,
    ("POST", "/v1/versions/{version}/exports"): TRAINER,
    ("GET", "/v1/exports/{export_id}"): TRAINER,
    ("POST", "/v1/sessions/{session_id}/finish"): TRAINER,
    ("GET", "/v1/trajectories"): TRAINER,
    ("POST", "/v1/trajectories/dropped"): TRAINER,
    ("POST", "/v1/trainer/report"): TRAINER,
    ("PUT", "/v1/trainer/version-host"): TRAINER,
    ("POST", "/v1/trajectories/outcomes"): TRAINER,
    # the trajectory export: reads without side effects, and its acks (retention reads them)
    ("GET", "/v1/export/trajectories"): READER | TRAINER,
    ("GET", "/v1/export/stream"): READER | TRAINER,
    ("GET", "/v1/export/status"): READER | TRAINER,
    ("GET", "/v1/export/versions"): READER | TRAINER,
    ("PUT", "/v1/export/ack"): READER | TRAINER,
    # agents: turns, and their own sessions (the handler answers 404 for another's)
    ("POST", "/v1/chat/completions"): AGENT,
    ("POST", "/v1/generate"): AGENT,
    ("GET", "/v1/sessions/{session_id}"): AGENT | TRAINER,
    # the cell protocol
    ("POST", "/internal/v1/cells/register"): CELL,
    ("POST", "/internal/v1/cells/{cell_id}/sync"): CELL,
    ("POST", "/internal/v1/migrations/{migration_id}/commit"): CELL,
    ("POST", "/internal/v1/migrations/{migration_id}/abort"): CELL,
    # RL jobs (docs/JOBS.md): a trainer token sees its own job only
    ("POST", "/v1/jobs"): ADMIN,
    ("GET", "/v1/jobs"): TRAINER,
    ("GET", "/v1/jobs/{name}"): TRAINER,
    ("DELETE", "/v1/jobs/{name}"): ADMIN,
    ("PATCH", "/v1/jobs/{name}"): ADMIN,
    ("POST", "/v1/jobs/{name}/cells"): ADMIN,
    # tokens
    ("POST", "/v1/tokens"): ADMIN,
    ("GET", "/v1/tokens"): ADMIN,
    ("DELETE", "/v1/tokens/{token_id}"): ADMIN,
}
"""(method, route path) → the scopes that may call it (admin may call every one)."""

TURN_ROUTES = frozenset({("POST", "/v1/chat/completions"), ("POST", "/v1/generate")})
"""Routes that run a turn on a session: an agent token's concurrency cap counts them."""


@dataclass(frozen=True, slots=True)
class Match:
    key: tuple[str, str] | None
    """The matched route's (method, path); None when no route serves them."""
    scopes: frozenset[str]
    """Who may call it; empty when no route serves this method and path (any valid token
    then gets the router's 404)."""
    allow: tuple[str, ...] = ()
    """With no route for this method: the methods routes serve at this path (a 405's Allow)."""


def route_keys(routes: list) -> list[tuple[tuple[str, str], re.Pattern]]:
    """Each served route's (method, path) key with its path pattern (a mount once, as MOUNT),
    included routers' routes among them."""
    out = []
    for r in (iter_route_contexts(routes) if iter_route_contexts is not None else routes):
        original = getattr(r, "original_route", r)
        path = r.path
        if isinstance(original, Mount):
            out.append((("MOUNT", path), compile_path(path.rstrip("/") + "/{path:path}")[0]))
            continue
        regex = compile_path(path)[0]
        for m in sorted(r.methods or ()):
            if m != "HEAD":  # Starlette adds HEAD to every GET route
                out.append(((m, path), regex))
    return out


class ScopeResolver:
    """Resolves a request's method and path to its route's scopes, over the app's routes
    (read on first use: every router is included by then)."""

    def __init__(self, routes: list) -> None:
        self._routes = routes
        self._compiled: list[tuple[tuple[str, str], re.Pattern]] | None = None

    def match(self, method: str, path: str) -> Match:
        if self._compiled is None:
            self._compiled = route_keys(self._routes)
        method = "GET" if method == "HEAD" else method
        public_path, allow = False, set()
        for key, regex in self._compiled:
            if regex.match(path):
                if key[0] in (method, "MOUNT"):
                    return Match(key, ROUTE_SCOPES.get(key, ADMIN))
                public_path = public_path or ROUTE_SCOPES.get(key) == PUBLIC
                allow.add(key[0])
        if "GET" in allow:
            allow.add("HEAD")
        # another method on a public path: its 405 needs no token either
        return Match(None, PUBLIC if public_path else frozenset(), tuple(sorted(allow)))

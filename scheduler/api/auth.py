"""Scoped bearer tokens, on by default: a pure ASGI middleware, so every route (the gateway,
/docs, /metrics included) is checked before any body is read.

A request's token resolves to a principal (its id and scope) through the `TokenRegistry`
(the bootstrap tokens of scheduler/contract/tokens.py and the tokens created at run time,
held as SHA-256 digests); its route's scopes come from the one table in scheduler/api/scopes.py.
No or unknown token: 401. Known token out of scope: 403. An agent token has its own budget
(`scheduler.agent_limits`): a request rate and a cap on turns in flight, 429 past either.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.api.principal import CURRENT, JOB_SCOPES, Principal
from scheduler.api.scopes import PUBLIC, TURN_ROUTES, ScopeResolver
from scheduler.contract.config import ConfigError
from scheduler.contract.config.scheduler import AgentLimits
from scheduler.contract.errors import Conflict, Invalid, NotFound
from scheduler.contract.tokens import SCOPES, new_token, token_hash

if TYPE_CHECKING:
    from scheduler.store import Store
    from scheduler.store.tokens import TokenRow

log = logging.getLogger("cellflip.scheduler")

MAX_TOKENS = 10_000
"""Tokens (live and revoked) the store keeps; creating past it is refused."""


class TokenRegistry:
    """Every token the scheduler accepts, by digest. Bootstrap tokens resolve from the start;
    `open(store)` records them in the store (a revoked one stays revoked across restarts) and
    loads the tokens created at run time. Create and revoke write the store, then the map, in
    the one event-loop thread: a revoked token is refused from the next request on."""

    def __init__(self, bootstrap: dict[str, str]) -> None:
        self._bootstrap = {scope: token_hash(tok) for scope, tok in bootstrap.items()}
        self._by_hash: dict[str, Principal] = {
            h: Principal(f"{scope}-bootstrap", scope, f"bootstrap {scope}") for scope, h in self._bootstrap.items()}
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._digests: dict[str, str] = {}
        """token → its digest, for the tokens that resolved (`resolve`)."""

    def open(self, store: Store) -> None:
        from scheduler.store.tokens import TokenRow

        by_hash: dict[str, Principal] = {}
        for scope, h in self._bootstrap.items():
            row = store.tokens.by_hash(h)
            if row is None:
                row = TokenRow(f"{scope}-bootstrap-{h[:8]}", scope, h, f"bootstrap {scope}", "bootstrap", time.time())
                store.tokens.insert(row)
            if row.scope != scope:
                raise ConfigError(f"the {scope} bootstrap token is the {row.scope} token {row.id}: "
                                  "give each scope a token of its own")
            if row.revoked_at is not None:
                log.error("the %s bootstrap token (%s) was revoked: it is refused; delete its file (or "
                          "give another) to generate a new one", scope, row.id)
        jobs = store.jobs.jobs_of("token")
        for row in store.tokens.all():
            if row.revoked_at is None:
                by_hash[row.hash] = Principal(row.id, row.scope, row.name, jobs.get(row.id, "default"))
        with self._lock:
            self._by_hash = by_hash
            self._store = store

    def resolve(self, token: str) -> Principal | None:
        """The token's principal (None: unknown or revoked). The digest of a token that resolved
        once is kept (`_digests`: at most one per token the store holds, as only tokens that
        resolve are kept), so a cell's sync is not hashed again each second; the principal is
        looked up by digest every time, so a revocation applies from the next request on."""
        h = self._digests.get(token)
        if h is None:
            h = token_hash(token)
            if h in self._by_hash and len(self._digests) < MAX_TOKENS + len(self._bootstrap):
                self._digests[token] = h
        return self._by_hash.get(h)

    def _require_store(self) -> Store:
        if self._store is None:
            raise Conflict("the token registry is not open", code="not_ready")
        return self._store

    def list(self) -> list[TokenRow]:
        return self._require_store().tokens.all()

    def create(self, scope: str, name: str, job: str | None = None) -> tuple[TokenRow, str]:
        """A new token of `scope` (an agent or trainer token of `job`, `default` when None);
        returns its row and the token (shown once, never stored)."""
        from scheduler.store.tokens import TokenRow

        if scope not in SCOPES:
            raise Invalid(f"unknown scope {scope!r} (one of {', '.join(SCOPES)})")
        store = self._require_store()
        job = _token_job(store, scope, job)
        if len(store.tokens.all()) >= MAX_TOKENS:
            raise Conflict(f"the store holds {MAX_TOKENS} tokens already", code="too_many_tokens")
        token = new_token()
        row = TokenRow(f"tok-{uuid.uuid4().hex[:12]}", scope, token_hash(token), name, "api", time.time())
        with store.tx(durable=True):
            store.tokens.insert(row)
            store.jobs.assign("token", row.id, job)
        with self._lock:
            self._by_hash[row.hash] = Principal(row.id, row.scope, row.name, job)
        return row, token

    def job_of(self, token_id: str) -> str:
        return self._require_store().jobs.job_of("token", token_id)

    def jobs_of_tokens(self) -> dict[str, str]:
        """token id → job, for the tokens bound to a job other than `default`."""
        return self._require_store().jobs.jobs_of("token")

    def revoke(self, token_id: str) -> TokenRow:
        """Revoke a token: refused from the next request on, and across restarts. The last
        live admin token cannot be revoked (nothing could create tokens after it)."""
        store = self._require_store()
        row = store.tokens.get(token_id)
        if row is None:
            raise NotFound(f"unknown token {token_id!r}")
        if row.revoked_at is None:
            admins = [r for r in store.tokens.all() if r.scope == "admin" and r.revoked_at is None]
            if row.scope == "admin" and len(admins) <= 1:
                raise Conflict("this is the last admin token: create another admin token first",
                               code="last_admin_token")
            row.revoked_at = store.tokens.revoke(token_id)
            with self._lock:
                self._by_hash.pop(row.hash, None)
        return row


def _token_job(store: Store, scope: str, job: str | None) -> str:
    """The job a new token is bound to: only agent and trainer tokens take one, of an active job."""
    if job is None:
        return "default"
    if scope not in JOB_SCOPES:
        raise Invalid(f"a {scope} token belongs to no job (only agent and trainer tokens do)")
    row = store.jobs.get(job)
    if row is None or row.state != "active":
        raise NotFound(f"no active job {job!r}", code="unknown_job")
    return job


class _Bucket:
    __slots__ = ("level", "at", "inflight")

    def __init__(self, level: float, at: float) -> None:
        self.level, self.at, self.inflight = level, at, 0


class AgentBudget:
    """Per agent token: a token bucket of requests, and the turns it has in flight."""

    def __init__(self, limits: AgentLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def admit(self, agent_id: str) -> float | None:
        """Take one request from the token's bucket; None if admitted, else seconds until one is there."""
        now = self.clock()
        b = self._buckets.get(agent_id)
        if b is None:
            b = self._buckets[agent_id] = _Bucket(float(self.limits.burst), now)
        b.level = min(float(self.limits.burst), b.level + (now - b.at) * self.limits.requests_per_s)
        b.at = now
        if b.level < 1.0:
            return (1.0 - b.level) / self.limits.requests_per_s
        b.level -= 1.0
        return None

    def start_turn(self, agent_id: str) -> bool:
        b = self._buckets[agent_id]
        if b.inflight >= self.limits.max_concurrent_sessions:
            return False
        b.inflight += 1
        return True

    def end_turn(self, agent_id: str) -> None:
        self._buckets[agent_id].inflight -= 1


def _answer(status: int, reason: str, msg: str, err_type: str, code: str, extra: list | None = None):
    """The API's {detail, reason} and, for the OpenAI-compatible gateway, an OpenAI error object."""
    body = json.dumps({"detail": msg, "reason": reason, "error": {
        "message": msg, "type": err_type, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    return {"type": "http.response.start", "status": status, "headers": headers}, {
        "type": "http.response.body", "body": body}


class ScopedAuth:
    """The middleware. `registry` resolves tokens; `routes` is the app's route list (resolved
    to scopes on first use); `budget` applies the agent limits."""

    def __init__(self, app, registry: TokenRegistry, routes: list, budget: AgentBudget) -> None:
        self.app = app
        self.registry = registry
        self.resolver = ScopeResolver(routes)
        self.budget = budget

    def _bearer(self, scope) -> str | None:
        """The bearer token, or None when absent or ambiguous (two Authorization headers)."""
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return None
        got = values[0].decode("latin-1")
        kind, _, token = got.partition(" ")
        return token.strip() if kind.lower() == "bearer" and token.strip() else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        match = self.resolver.match(scope["method"], scope["path"])
        if match.scopes == PUBLIC and not match.allow:
            await self.app(scope, receive, send)
            return
        token = self._bearer(scope)
        principal = self.registry.resolve(token) if token else None
        if match.allow and (principal is not None or match.scopes == PUBLIC):
            # no route takes this method here: 405 naming every method some route takes
            # (the router's own answer names one route's only)
            await _send(send, *_answer(405, "method_not_allowed", f"{scope['method']} is not served at this path",
                                       "invalid_request_error", "method_not_allowed",
                                       [(b"allow", ", ".join(match.allow).encode())]))
            return
        if principal is None:
            await _send(send, *_answer(401, "unauthorized", "missing or invalid bearer token",
                                       "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")]))
            return
        if match.key is not None and principal.scope != "admin" and principal.scope not in match.scopes:
            method, path = match.key
            await _send(send, *_answer(403, "forbidden", f"a {principal.scope} token cannot use {method} {path}",
                                       "permission_error", "insufficient_scope"))
            return
        turn = False
        if principal.scope == "agent":
            wait = self.budget.admit(principal.id)
            if wait is not None:
                await _send(send, *_limited(f"request rate over {self.budget.limits.requests_per_s:g}/s for this "
                                            "agent token", wait))
                return
            if match.key in TURN_ROUTES:
                if not self.budget.start_turn(principal.id):
                    await _send(send, *_limited(f"{self.budget.limits.max_concurrent_sessions} sessions of this "
                                                "agent token have a turn in flight", 1.0))
                    return
                turn = True
        reset = CURRENT.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT.reset(reset)
            if turn:
                self.budget.end_turn(principal.id)


def _limited(msg: str, wait_s: float):
    return _answer(429, "rate_limited", msg, "rate_limit_error", "rate_limited",
                   [(b"retry-after", str(max(1, math.ceil(wait_s))).encode())])


async def _send(send, start, body) -> None:
    await send(start)
    await send(body)

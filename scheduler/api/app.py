"""The scheduler's FastAPI app: `create_app(config) -> FastAPI`.

The lifespan opens the store, builds the controller (which rebuilds from the store) onto
`app.state.controller` and runs the control loop; routers read it from there. The bootstrap
tokens are read when the app is created, so an unreadable token file stops start-up at once;
the lifespan then opens the token registry on the store (`app.state.tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from pydantic import TypeAdapter

from scheduler.api.auth import AgentBudget, ScopedAuth, TokenRegistry
from scheduler.api.completions import generate_body_bound
from scheduler.api.docs import declare_rules, install_docs
from scheduler.api.export import Retention
from scheduler.api.jsontext import SafeJSONResponse
from scheduler.api.limits import BodySizeLimit
from scheduler.api.routes import ROUTERS
from scheduler.api.schemas import CompletionCreate
from scheduler.contract.config import (
    SCHEDULER_CONFIG_ENV,
    SHARED_PROCESS_ENV,
    CellflipConfig,
    ConfigError,
    parse_config,
)
from scheduler.contract.config.gateway import GatewayConfig
from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig, VersionsConfig
from scheduler.contract.errors import CellflipError, Invalid, http_answer
from scheduler.contract.protocol import ProtocolError, SyncRequest
from scheduler.contract.tokens import server_tokens
from scheduler.control.controller import Controller
from scheduler.control.metrics import Metrics
from scheduler.control.stallclock import StallClock
from scheduler.gateway.control_backend import ControlPlaneBackend
from scheduler.gateway.router import make_chat_router
from scheduler.gateway.tito.backend import CallbackCounters
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest
from scheduler.store import Store

log = logging.getLogger("cellflip.scheduler")

DEFAULT_TICK_S = 0.2
"""Control-loop period; a flip request or a new cell also wakes the loop at once."""


def create_app(config: CellflipConfig | SchedulerConfig | None = None, *, db_path: str | None = None,
               clock: Callable[[], float] = time.monotonic, tick_interval_s: float | None = DEFAULT_TICK_S,
               manage_gc: bool = True) -> FastAPI:
    """Build the app. `tick_interval_s=None` runs no background loop (tests tick by hand);
    `clock` is the monotonic clock of leases and deadlines; `manage_gc`: the running loop paces
    the process's garbage collection (scheduler/contract/gcpolicy.py), for a scheduler that owns
    its process."""
    if isinstance(config, CellflipConfig):
        sched, migration, gateway, vers = config.scheduler, config.migration, config.gateway, config.versions
    else:
        sched, migration, gateway, vers = config or SchedulerConfig(), MigrationConfig(), GatewayConfig(), VersionsConfig()
    # tokens live beside the store this app opens (db_path overrides the config's)
    where = sched.model_copy(update={"db_path": db_path or sched.db_path})
    tokens = server_tokens(where)
    registry = TokenRegistry(tokens) if tokens is not None else None
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(db_path or sched.db_path)
        if registry is not None:
            registry.open(store)
        # on a live loop, leases and deadlines do not run through the loop's own stalls
        stall = StallClock(clock, on_lag=metrics.loop_lag.observe) if tick_interval_s else None
        ctl = Controller(store, sched, migration, clock=stall or clock, metrics=metrics, versions=vers)
        app.state.controller = ctl
        tasks = [asyncio.create_task(ctl.run(tick_interval_s, manage_gc=manage_gc)),
                 asyncio.create_task(stall.run()), asyncio.create_task(app.state.retention.run(store))] if stall is not None else []
        try:
            yield
        finally:
            ctl.close()
            await asyncio.sleep(0)  # let woken streams see `closing` before the store closes
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            store.close()

    app = FastAPI(title="cellflip scheduler", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  default_response_class=SafeJSONResponse,
                  description="Control plane: cells, flips, weight versions, sessions, completions.")
    app.state.metrics, app.state.tokens = metrics, registry
    app.state.retention = Retention(sched.store.retain_trajectories, metrics.registry)
    for router in ROUTERS:
        app.include_router(router)
    chat = _chat_router(app, gateway, metrics)
    app.include_router(chat)
    _install_error_handlers(app)
    _publish_chat_schemas(app)
    install_docs(app)
    # outermost first: refuse unauthenticated requests before reading any body
    app.add_middleware(BodySizeLimit, max_bytes=sched.max_body_bytes, bounds=_body_bounds(app, chat))
    if registry is not None:
        app.add_middleware(ScopedAuth, registry=registry, routes=app.router.routes,
                           budget=AgentBudget(sched.agent_limits))
    return app


def _chat_router(app: FastAPI, gateway: GatewayConfig, metrics: Metrics):
    """The chat gateway on the control plane: turns recorded on the durable session store,
    decoded on the cells, routed to the RL job their `model` names; its own finish route off
    (the sessions router serves it)."""
    backend = ControlPlaneBackend(app)
    return make_chat_router(backend, gateway.renderer, counters=CallbackCounters(
        lambda n: metrics.drift.inc(n), metrics.history_rewrites.inc),
        **{**gateway.router_kwargs(), "finish_route": False, "route_model": backend.route_model})


def _body_bounds(app: FastAPI, chat) -> dict:
    """Per route, the most bytes a body holding a prompt the model takes can have, once known."""
    return {"/v1/generate": lambda: generate_body_bound(getattr(app.state, "controller", None)),
            "/v1/chat/completions": lambda: chat.body_bound}


def create_app_from_env() -> FastAPI:
    """The app of a server started by module path (`uvicorn.Config("scheduler.api.app:create_app_from_env",
    factory=True)`): its config is the JSON text in $CELLFLIP_SCHEDULER_CONFIG."""
    text = os.environ.get(SCHEDULER_CONFIG_ENV)
    if not text:
        raise ConfigError(f"${SCHEDULER_CONFIG_ENV} holds no config")
    return create_app(parse_config(json.loads(text), f"${SCHEDULER_CONFIG_ENV}"),
                      manage_gc=os.environ.get(SHARED_PROCESS_ENV) != "1")


def _publish_chat_schemas(app: FastAPI) -> None:
    """The chat route's and /v1/generate's bodies are read raw (to bound and refuse them
    before parsing, and to parse large ones off the event loop), and a cell's sync body (parsed
    and validated in one pass): their models and nested models join the document's components,
    so every `$ref` in /openapi.json resolves."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = base()
            known = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionCreate, SyncRequest):  # bodies read raw by their routes
                schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in schema.pop("$defs", {}).items():
                    known.setdefault(name, sub)
                known.setdefault(model.__name__, schema)
            declare_rules(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CellflipError)
    async def _domain(_: Request, exc: CellflipError) -> SafeJSONResponse:
        status, body, headers = http_answer(exc)
        return SafeJSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> SafeJSONResponse:
        status, body, headers = http_answer(Invalid(str(exc)))  # a malformed cell message
        return SafeJSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> SafeJSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return SafeJSONResponse({"detail": "internal error", "reason": "internal"}, status_code=500)

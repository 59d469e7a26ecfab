"""The toy task's one link to the scheduler's gateway logic.

Every scheduler name the toy task uses comes through here, so that one module says what it
needs of the gateway: the TITO gateway (`TitoGateway`, its `GatewayError`, the request
schema) over the in-memory session store (`InMemoryBackend`), the scripted engine of the
demos (`ReplayEngine`) and the token record an engine yields (`TokenOut`), and the chat
renderer (`load_renderer`, which the demos and the output-id list need on their own).
"""

from __future__ import annotations

from typing import Any

from scheduler.gateway.tito.backend import TokenOut
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest
from scheduler.gateway.tito.render import load_renderer
from scheduler.gateway.tito.tito import GatewayError, TitoGateway

__all__ = [
    "GatewayError",
    "InMemoryBackend",
    "ReplayEngine",
    "TitoGateway",
    "TokenOut",
    "chat_turn",
    "load_renderer",
    "local_gateway",
]


def local_gateway(engine: Any, renderer: str) -> tuple[InMemoryBackend, Any, TitoGateway]:
    """(in-memory store of one cell over `engine`, the renderer, the TITO gateway over them)."""
    backend = InMemoryBackend(engine, cells=("cell-0",))
    rend = load_renderer(renderer)
    return backend, rend, TitoGateway(backend, rend)


async def chat_turn(gateway: TitoGateway, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion turn of `session_id` (an OpenAI request body); the assistant
    message. Raises `GatewayError` for a request the gateway refuses."""
    req = ChatCompletionRequest.model_validate(body)
    async with gateway.session_lock(session_id):
        plan = await gateway.plan(session_id, req)
        res = await gateway.start(plan).run()
    return res.message

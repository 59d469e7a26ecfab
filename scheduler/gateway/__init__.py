"""TITO gateway: OpenAI Chat Completions for agent harnesses, exact token ids for RL.

- :mod:`~scheduler.gateway.tokenizers`: offline Qwen3 / DeepSeek-V3 tokenizers (full vocab).
- :mod:`~scheduler.gateway.render`: chat templates and tool-call parsing via ``renderers``.
- :mod:`~scheduler.gateway.tito`: the per-session TITO buffer logic (and its loss-mask rule),
  composed of :mod:`~scheduler.gateway.chat_request` (request -> messages, tools, sampling
  params), :mod:`~scheduler.gateway.fingerprints`, :mod:`~scheduler.gateway.planning` (a
  turn's prompt ids), :mod:`~scheduler.gateway.turn` (writing and committing a turn) and
  :mod:`~scheduler.gateway.session_locks`; :mod:`~scheduler.gateway.errors` has
  ``GatewayError``.
- :mod:`~scheduler.gateway.backend`: the protocol the application implements.
- :mod:`~scheduler.gateway.memory`: in-memory reference backend and replay engine.
- :mod:`~scheduler.gateway.router`: ``make_chat_router(backend, tokenizer_name, ...)``, a thin
  router over :mod:`~scheduler.gateway.intake` (the HTTP body in),
  :mod:`~scheduler.gateway.responses` (completion and error bodies) and
  :mod:`~scheduler.gateway.streaming` (SSE chunks).
- :mod:`~scheduler.gateway.config`: ``GatewayConfig`` (settings for the router).

Importing this package loads no tokenizer and no renderer; they are built on first use.
"""

from scheduler.gateway.backend import (
    BackendBusy,
    BackendError,
    BackendUnavailable,
    CallbackCounters,
    CompletionBackend,
    GatewayCounters,
    PrometheusCounters,
    SessionFinished,
    SessionNotFound,
    SessionTokens,
    SimpleCounters,
    TokenOut,
)
from scheduler.gateway.config import GatewayConfig
from scheduler.gateway.memory import InMemoryBackend, ReplayEngine
from scheduler.gateway.render import RENDERER_PRESETS, ChatRenderer, load_renderer
from scheduler.gateway.router import SESSION_HEADER, make_chat_router
from scheduler.gateway.tito import GatewayError, TitoGateway
from scheduler.gateway.tokenizers import TOKENIZER_NAMES, load_tokenizer

__all__ = [
    "BackendBusy",
    "BackendError",
    "BackendUnavailable",
    "CallbackCounters",
    "ChatRenderer",
    "CompletionBackend",
    "GatewayConfig",
    "GatewayCounters",
    "GatewayError",
    "InMemoryBackend",
    "PrometheusCounters",
    "RENDERER_PRESETS",
    "ReplayEngine",
    "SESSION_HEADER",
    "SessionFinished",
    "SessionNotFound",
    "SessionTokens",
    "SimpleCounters",
    "TOKENIZER_NAMES",
    "TitoGateway",
    "TokenOut",
    "load_renderer",
    "load_tokenizer",
    "make_chat_router",
]

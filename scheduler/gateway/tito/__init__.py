"""Token-in/token-out chat logic, pure (no HTTP, no store): both the scheduler's gateway and the
toy task's in-process client run it.

- `tokenizers`: offline Qwen3 / DeepSeek-V3 tokenizers (full vocab).
- `render`: chat templates and tool-call parsing via ``renderers``.
- `tito`: the per-session TITO buffer logic (and its loss-mask rule), composed of
  `chat_request` (request -> messages, tools, sampling params), `fingerprints`, `planning` (a
  turn's prompt ids), `turn` (writing and committing a turn) and `session_locks`; `errors` has
  ``GatewayError``.
- `backend`: the protocol a session store and engine implement; `memory`: the in-memory
  reference backend and replay engine.
- `openai_schema`: the OpenAI Chat Completions request and response models.

Importing this package loads no tokenizer and no renderer; they are built on first use.
"""

from scheduler.gateway.tito.backend import (
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
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine
from scheduler.gateway.tito.render import RENDERER_PRESETS, ChatRenderer, load_renderer
from scheduler.gateway.tito.tito import GatewayError, TitoGateway
from scheduler.gateway.tito.tokenizers import TOKENIZER_NAMES, load_tokenizer

__all__ = [
    "BackendBusy",
    "BackendError",
    "BackendUnavailable",
    "CallbackCounters",
    "ChatRenderer",
    "CompletionBackend",
    "GatewayCounters",
    "GatewayError",
    "InMemoryBackend",
    "PrometheusCounters",
    "RENDERER_PRESETS",
    "ReplayEngine",
    "SessionFinished",
    "SessionNotFound",
    "SessionTokens",
    "SimpleCounters",
    "TOKENIZER_NAMES",
    "TitoGateway",
    "TokenOut",
    "load_renderer",
    "load_tokenizer",
]

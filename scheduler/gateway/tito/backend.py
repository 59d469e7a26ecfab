"""What the gateway needs from the rest of the control plane.

The gateway owns no storage and no cells. The application passes it an object satisfying
:class:`CompletionBackend` (the session store plus the router to cells) and a
:class:`GatewayCounters` for the two TITO counters. :mod:`scheduler.gateway.tito.memory` ships an
in-memory reference implementation backed by a deterministic replay engine.

Contract of :class:`CompletionBackend`:

- Sessions are created implicitly by the first :meth:`append_prompt_tokens`.
- A session's buffer is a list of *segments*; every call reads or extends the current one.
  :meth:`start_segment` opens a new, empty segment (the previous ones are kept untouched).
- :meth:`complete` routes the session to a cell (the same cell as its previous turns, for KV
  reuse, until a migration moves it), decodes from ``prompt_ids`` -- which equals the current
  segment's buffer, the gateway having appended the prompt tokens first -- and records every
  sampled token in the buffer (loss mask 1, behaviour log-prob, version) *before* yielding it.
  It may raise :class:`BackendBusy` / :class:`BackendUnavailable` (or any other
  :class:`BackendError`, with its own status and code) before the first token only.
  Closing the iterator early (a stop string, a client disconnect) stops decoding; what was
  yielded stays recorded.
- ``params`` are the turn's :class:`~scheduler.contract.sampling.SamplingParams` (their
  ``stop_token_ids`` always include the chat format's turn-closing ids).
- Gateway state is a small JSON-serialisable dict the gateway stores per session (message
  fingerprints and turn boundaries, never token ids); store it alongside the buffer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from scheduler.contract.errors import CellflipError, Conflict, NoCapacity, NotFound, Unavailable
from scheduler.contract.sampling import SamplingParams

__all__ = [
    "BackendBusy",
    "BackendError",
    "BackendUnavailable",
    "CallbackCounters",
    "CompletionBackend",
    "GatewayCounters",
    "PrometheusCounters",
    "Rewind",
    "SessionFinished",
    "SessionNotFound",
    "SessionTokens",
    "SimpleCounters",
    "TokenOut",
]


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One sampled token as the engine reports it."""

    token_id: int
    logprob: float
    version: int
    finish_reason: str | None = None
    """None until the last token of the completion: then ``"stop"`` or ``"length"``."""


@dataclass(frozen=True, slots=True)
class Rewind:
    """Yielded by :meth:`CompletionBackend.complete` only when not ``live``: the completion's
    tokens from index ``keep`` on were taken back (their sampler was found untrustworthy
    before anyone was shown them) and are being sampled again; drop them."""

    keep: int


@dataclass(slots=True)
class SessionTokens:
    """A slice of the session's current segment, as recorded in the store."""

    token_ids: list[int]
    loss_mask: list[int]
    segment: int
    """Index of the current segment (0 for the first)."""
    length: int
    """Length of the whole current segment (``token_ids`` may be a suffix of it)."""
    finished: bool = False
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    any_sampled: bool | None = None
    """Whether the whole segment holds a sampled token, where ``loss_mask`` covers only part of
    it (scheduler/gateway/tito/kept.py); None: ``any(loss_mask)``."""


BackendError = CellflipError
"""Base class of backend failures: the control plane's one error base (scheduler/contract/errors.py),
so a refusal raised anywhere behind the backend reaches the client with its own status and
code. The gateway turns each into an OpenAI error object (scheduler/gateway/responses.py)."""


class BackendBusy(NoCapacity):
    """No rollout cell has room for the session now (429 with Retry-After)."""

    def __init__(self, message: str = "no rollout capacity", retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class BackendUnavailable(Unavailable):
    code = "backend_unavailable"


class SessionNotFound(NotFound):
    code = "session_not_found"


class SessionFinished(Conflict):
    code = "session_finished"


@runtime_checkable
class CompletionBackend(Protocol):
    """Session store + cell routing, as the gateway uses them (see the module docstring)."""

    def complete(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, live: bool = True
    ) -> AsyncIterator[TokenOut | Rewind]:
        """Decode a completion for ``prompt_ids`` on the session's cell, recording each token.
        ``live``: each token is shown as it is yielded (a stream); else the whole completion is
        shown when the iteration ends, and a :class:`Rewind` may come before that."""
        ...

    async def get_session_tokens(self, session_id: str, start: int = 0) -> SessionTokens | None:
        """The current segment from ``start`` on; None for an unknown session."""
        ...

    async def append_prompt_tokens(
        self, session_id: str, ids: list[int], loss_mask: int = 0
    ) -> None:
        """Append non-sampled tokens to the current segment (creating the session if new)."""
        ...

    async def start_segment(self, session_id: str, reason: str) -> int:
        """Open a new empty segment and return its index."""
        ...

    async def get_gateway_state(self, session_id: str) -> dict[str, Any] | None: ...

    async def set_gateway_state(self, session_id: str, state: dict[str, Any]) -> None: ...

    async def finish_session(
        self, session_id: str, reward: float | None, group_id: str | None
    ) -> dict[str, Any]:
        """Close the session into a trajectory; a 404 (unknown session) or a 409 (finished
        already, or a request in flight) otherwise."""
        ...

    # Optional: ``async def admit(session_id, prompt_ids, params, new_ids=None) -> None`` raises
    # every refusal the turn would get (busy session, limits, capacity) before the gateway
    # records anything; ``new_ids``: the ids the turn appends (the rest are recorded already).
    # Optional: ``async def session_digest(session_id) -> str | None``, the current segment's
    # running-hash digest (scheduler/contract/prefixhash.py): the gateway then reads only the
    # tokens recorded since its last turn (scheduler/gateway/tito/kept.py).


# ------------------------------------------------------------------------------ counters
class GatewayCounters(Protocol):
    def retokenization_drift(self, n: int) -> None:
        """Recorded tokens that differ from the sampled ones (must stay 0)."""
        ...

    def history_rewrite(self) -> None:
        """A harness edited an earlier turn; a new segment was started."""
        ...


class SimpleCounters:
    """Plain integer counters (tests, the bench, an app without Prometheus)."""

    def __init__(self) -> None:
        self.retokenization_drift_total = 0
        self.history_rewrites_total = 0

    def retokenization_drift(self, n: int) -> None:
        self.retokenization_drift_total += n

    def history_rewrite(self) -> None:
        self.history_rewrites_total += 1


class CallbackCounters:
    """Forward both counters to callables supplied by the application."""

    def __init__(self, on_drift: Callable[[int], None], on_rewrite: Callable[[], None]) -> None:
        self._on_drift = on_drift
        self._on_rewrite = on_rewrite

    def retokenization_drift(self, n: int) -> None:
        self._on_drift(n)

    def history_rewrite(self) -> None:
        self._on_rewrite()


class PrometheusCounters:
    """``retokenization_drift_total`` and ``history_rewrites_total`` as Prometheus counters.

    Registers the two counters in ``registry`` (a ``prometheus_client.CollectorRegistry``;
    the default registry when None), or uses counters the application already created.
    """

    def __init__(self, registry: Any = None, *, drift: Any = None, rewrites: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        reg = REGISTRY if registry is None else registry
        self.drift = drift or Counter(
            "retokenization_drift",
            "Recorded tokens that differ from the tokens the policy sampled (must stay 0).",
            registry=reg,
        )
        self.rewrites = rewrites or Counter(
            "history_rewrites",
            "Harness edits of earlier turns, each starting a new session segment.",
            registry=reg,
        )

    def retokenization_drift(self, n: int) -> None:
        if n:
            self.drift.inc(n)

    def history_rewrite(self) -> None:
        self.rewrites.inc()

"""The control plane's one error hierarchy, and its one translation into an HTTP answer.

Every refusal is a `CellflipError`: an HTTP `status`, a short machine-readable `code` beside
the human `detail`, and `retry_after_s` where retrying later makes sense. The REST API answers
`{"detail": ..., "reason": <code>}` (`http_answer`); the chat gateway answers the same error
as an OpenAI error object (scheduler/gateway/responses.py), so a cell, a trainer or a client
branches on the same code either way. The gateway's own names (`BackendError`, `BackendBusy`,
`SessionNotFound`, ...: scheduler/gateway/tito/backend.py) and its request refusals
(`GatewayError`) are this hierarchy too: an error raised anywhere in the control plane reaches
the client as it was raised, never re-wrapped.
"""

from __future__ import annotations

from typing import Any, ClassVar


class CellflipError(Exception):
    """Base class: `status` is the HTTP status, `code` the machine-readable reason."""

    status: ClassVar[int] = 500
    code: str = "error"
    retry_after_s: float | None = None

    def __init__(self, detail: str = "", code: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


def http_answer(exc: CellflipError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of the REST API's answer to `exc`: the body is `ApiError`
    (scheduler/api/schemas.py); a `retry_after_s` becomes a whole-second Retry-After."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return exc.status, {"detail": exc.detail, "reason": exc.code}, headers


class NotFound(CellflipError):
    """An unknown id (cell, flip, version, session, migration)."""

    status = 404
    code = "not_found"


class TooLarge(CellflipError):
    """A body over the size its route can take."""

    status = 413
    code = "too_large"


class Conflict(CellflipError):
    """An illegal transition, a stale generation/epoch/incarnation, a lost compare-and-set."""

    status = 409
    code = "conflict"


class Invalid(CellflipError):
    """Well-formed JSON that breaks a rule pydantic cannot express (e.g. a bad event)."""

    status = 422
    code = "invalid"


class NoCapacity(CellflipError):
    """No rollout cell has room (or the staleness bound holds admission): retry after
    `retry_after_s`."""

    status = 429
    code = "no_capacity"
    retry_after_s = 1.0


class Unavailable(CellflipError):
    """The control plane cannot serve the request now (the gateway's `BackendUnavailable`)."""

    status = 503
    code = "unavailable"


class EngineError(ValueError):
    """Bad input to an engine: sampling params out of range, an unknown request, a model of
    another shape. Raised inside a cell (the engines, `SamplingParams` built there); no HTTP
    answer of its own."""

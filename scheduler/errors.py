"""Domain errors of the control plane; the app maps each to a status code with a JSON detail.

Every error carries a short machine-readable `reason` beside the human `detail`, so a cell or
a trainer can branch on it (`{"detail": "...", "reason": "stale_epoch"}`).
"""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class: `status` is the HTTP status the API answers with."""

    status = 500
    default_reason = "error"

    def __init__(self, detail: str, reason: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.reason = reason or self.default_reason


class NotFound(SchedulerError):
    """An unknown id (cell, flip, version, session, migration)."""

    status = 404
    default_reason = "not_found"


class Conflict(SchedulerError):
    """An illegal transition, a stale generation/epoch/incarnation, a lost compare-and-set."""

    status = 409
    default_reason = "conflict"


class Invalid(SchedulerError):
    """Well-formed JSON that breaks a rule pydantic cannot express (e.g. a bad event)."""

    status = 422
    default_reason = "invalid"


class NoCapacity(SchedulerError):
    """No rollout cell has room: the client retries after `retry_after_s`."""

    status = 429
    default_reason = "no_capacity"

    def __init__(self, detail: str, retry_after_s: float = 1.0) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s

"""One error hierarchy: the API's and the gateway's refusals share a base and one translation."""

from __future__ import annotations

from scheduler.contract.errors import (
    CellflipError,
    Conflict,
    Invalid,
    NoCapacity,
    NotFound,
    http_answer,
)
from scheduler.contract.states import IllegalTransition
from scheduler.gateway.tito.backend import (
    BackendBusy,
    BackendError,
    BackendUnavailable,
    SessionFinished,
    SessionNotFound,
)


def test_every_refusal_is_a_cellflip_error():
    assert BackendError is CellflipError
    for cls in (NotFound, Conflict, Invalid, NoCapacity, IllegalTransition, BackendBusy, BackendUnavailable,
                SessionNotFound, SessionFinished):
        assert issubclass(cls, CellflipError), cls


def test_status_code_and_retry_after_per_class():
    assert (NotFound("x").status, NotFound("x").code) == (404, "not_found")
    assert (Conflict("x", code="stale_epoch").status, Conflict("x", code="stale_epoch").code) == (409, "stale_epoch")
    assert (IllegalTransition("x").status, IllegalTransition("x").code) == (409, "illegal_transition")
    busy = BackendBusy()
    assert (busy.status, busy.code, busy.retry_after_s) == (429, "no_capacity", 1.0)
    assert isinstance(busy, NoCapacity) and str(busy) == "no rollout capacity"
    assert (BackendUnavailable("down").status, BackendUnavailable("down").code) == (503, "backend_unavailable")
    assert (SessionNotFound("s").status, SessionFinished("s").status) == (404, 409)
    assert NotFound("x").retry_after_s is None


def test_one_translation_to_the_api_answer():
    assert http_answer(NoCapacity("full", code="staleness_bound", retry_after_s=2.4)) == (
        429, {"detail": "full", "reason": "staleness_bound"}, {"Retry-After": "2"})
    assert http_answer(NoCapacity("full", retry_after_s=0.2))[2] == {"Retry-After": "1"}
    assert http_answer(Conflict("busy", code="session_busy")) == (409, {"detail": "busy", "reason": "session_busy"}, {})

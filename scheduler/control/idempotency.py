"""Idempotency-Key on the public mutating routes that are not idempotent by themselves:
flips, completions, version publishes. The first request's answer is recorded in the same
durable transaction as its effect; a replay with the same key and body gets that answer; the
same key with another body is a 409. A refused request records nothing, so its key stays free.
(A session finish and a version retirement replay to the same answer without a key.) Keys
are kept `idempotency_ttl_s` (a day by default).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict

if TYPE_CHECKING:
    from scheduler.store import Store


def fingerprint(body: Any) -> str:
    """What a replay must repeat exactly (JSON, keys sorted)."""
    return json.dumps(body, sort_keys=True)


def replay(store: Store, scope: str, key: str | None, fp: str) -> Any | None:
    """The recorded answer when `key` was used before with this body; None on first use (or
    without a key); a 409 when it was used with another body."""
    if key is None:
        return None
    hit = store.fleet.get_idempotent(scope, key)
    if hit is None:
        return None
    if hit[0] != fp:
        raise Conflict("Idempotency-Key reused with a different request", code="idempotency_key_reused")
    return hit[1]


def expire(store: Store, ttl_s: float, now: float | None = None) -> int:
    """Forget keys older than `ttl_s` (`idempotency_ttl_s`, run from the slow tick); returns
    how many."""
    with store.tx(durable=False):
        return store.fleet.expire_idempotent((time.time() if now is None else now) - ttl_s)


def record(store: Store, scope: str, key: str | None, fp: str, answer: Any) -> None:
    """Inside the transaction that made the effect: remember the answer for replays."""
    if key is not None:
        store.fleet.put_idempotent(scope, key, fp, answer)

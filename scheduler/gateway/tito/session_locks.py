"""Per-session locks: turns of one session run one at a time, in arrival order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SessionLocks"]


@dataclass
class _Lock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    """Holders and waiters; the entry is dropped when it falls to 0."""


class SessionLocks:
    """One lock per session id, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, _Lock] = {}

    def hold(self, session_id: str) -> _SessionLock:
        """An async context manager that holds the session's lock."""
        return _SessionLock(self._locks, session_id)

    def forget(self, session_id: str) -> None:
        """Drop the session's entry if nobody holds or waits for it."""
        entry = self._locks.get(session_id)
        if entry is not None and entry.users == 0:
            self._locks.pop(session_id, None)


class _SessionLock:
    def __init__(self, locks: dict[str, _Lock], session_id: str) -> None:
        self.locks, self.sid = locks, session_id

    async def __aenter__(self) -> None:
        entry = self.locks.setdefault(self.sid, _Lock())
        entry.users += 1
        try:
            await entry.lock.acquire()
        except BaseException:
            entry.users -= 1
            raise

    async def __aexit__(self, *exc: Any) -> None:
        entry = self.locks[self.sid]
        entry.lock.release()
        entry.users -= 1
        if entry.users == 0:  # nobody holds or waits: drop it (no await since the check)
            self.locks.pop(self.sid, None)

"""Wake-ups on the event loop: a waiter parks on a key, `notify(key)` releases every waiter.

Used for two waits: a client stream waiting for its request's next committed tokens, and a
cell's long-poll sync waiting for a command. Callers check their condition and park without
an `await` in between, so a notify can never fall between the check and the wait (all of this
runs on the one event-loop thread).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable


class Notifier:
    def __init__(self) -> None:
        self._events: dict[Hashable, asyncio.Event] = {}

    async def wait(self, key: Hashable, timeout: float) -> bool:
        """Park until `notify(key)` or `timeout` seconds; True when notified."""
        if timeout <= 0:
            return False
        event = self._events.setdefault(key, asyncio.Event())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return event.is_set()

    def notify_all(self) -> None:
        """Release every waiter (shutdown)."""
        for key in list(self._events):
            self.notify(key)

    def notify(self, key: Hashable) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

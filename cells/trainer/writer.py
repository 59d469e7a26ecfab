"""Writes that must not hold up a training step (checkpoints, weight exports): each runs on a
thread of its own from a copy taken at the step, one at a time per kind and in order, and
reports `<kind>ed` (with its seconds) or `<kind>_failed` (with the error) through `emit`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from cells.engine.records import EngineError


class BackgroundWriter:
    def __init__(self, emit: Callable[[dict[str, Any]], None]) -> None:
        self.emit = emit
        self.last: dict[str, threading.Thread] = {}

    def submit(self, kind: str, write: Callable[[], None], **about: Any) -> None:
        """Run `write` after the previous write of `kind` ended (it holds a copy, never live state)."""
        before = self.last.get(kind)

        def run() -> None:
            if before is not None:
                before.join()
            t0 = time.monotonic()
            try:
                write()
            except (OSError, EngineError, TypeError, ValueError) as e:
                self.emit({"event": f"{kind}_failed", **about, "error": str(e)})
                return
            self.emit({"event": f"{kind}ed", **about, "seconds": round(time.monotonic() - t0, 2)})

        t = self.last[kind] = threading.Thread(target=run, name=f"{kind}-writer", daemon=False)
        t.start()

    def flush(self) -> None:
        """Wait for every write submitted so far."""
        for t in list(self.last.values()):
            t.join()

"""The client-visible stall of each live KV migration, as the scheduler's own token stream
sees it (tokens reach the store before any client sees them, so its arrivals are the
client's, less the network).

One line: command → watch arrivals → commit → 32 tokens later: largest gap − typical gap.

Per move, the window runs from the migration command to `AFTER_COMMIT` tokens after the
commit; the stall is the largest gap between two token arrivals in that window (the gap that
straddles the command included) minus the request's typical gap, its span over count in the
`TYPICAL_S` before the command. An aborted move records nothing (the source kept decoding);
a request that ends before `AFTER_COMMIT` tokens is measured on what it had. A move that
re-submits the session (`kv_store`, `reprefill`) is watched the same way from its command, its
commit being the owner change itself. Each measured stall comes back with the move's `tag` (the
caller's: its migration id and path), so it lands on the move's row as well as the histogram.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

AFTER_COMMIT = 32
"""Tokens after the commit that the window still covers (the destination's warm-up)."""
TYPICAL_S = 2.0
"""The typical inter-token gap is measured over this many seconds before the command."""
HISTORY = 64
"""Arrival batches remembered per request (enough for `TYPICAL_S` at any batch rate here)."""


class Stall(NamedTuple):
    seconds: float
    """The client-visible stall: largest gap in the window minus the typical gap."""
    tag: Any
    """What `started` was given for the move."""


@dataclass(slots=True)
class _Watch:
    started: float
    typical: float | None
    last: float | None
    """Arrival before the command (the straddling gap starts there)."""
    largest: float = 0.0
    after_commit: int | None = None
    """Tokens since the commit; None before it."""
    tag: Any = None


@dataclass
class StallMeter:
    arrivals: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    watches: dict[str, _Watch] = field(default_factory=dict)

    def on_tokens(self, rid: str, n: int, now: float) -> Stall | None:
        """`n` tokens of `rid` stored at `now`. Returns a finished move's stall (seconds)."""
        hist = self.arrivals.get(rid)
        if hist is None:
            hist = self.arrivals[rid] = deque(maxlen=HISTORY)
        hist.append((now, n))
        w = self.watches.get(rid)
        if w is None:
            return None
        if w.last is not None:
            w.largest = max(w.largest, now - w.last)
        w.last = now
        if w.after_commit is None:
            return None
        w.after_commit += n
        return self._close(rid) if w.after_commit >= AFTER_COMMIT else None

    def started(self, rid: str, now: float, tag: Any = None) -> None:
        hist = self.arrivals.get(rid, ())
        recent = [(t, n) for t, n in hist if t >= now - TYPICAL_S]
        typical = None
        if len(recent) >= 2:
            span, count = recent[-1][0] - recent[0][0], sum(n for _, n in recent[1:])
            typical = span / count if count else None
        self.watches[rid] = _Watch(now, typical, hist[-1][0] if hist else None, tag=tag)

    def committed(self, rid: str) -> None:
        if (w := self.watches.get(rid)) is not None:
            w.after_commit = 0

    def aborted(self, rid: str) -> None:
        self.watches.pop(rid, None)

    def ended(self, rid: str) -> Stall | None:
        """`rid` finished or left this scheduler: forget it; a committed move is measured."""
        self.arrivals.pop(rid, None)
        w = self.watches.get(rid)
        return self._close(rid) if w is not None and w.after_commit is not None else None

    def _close(self, rid: str) -> Stall:
        w = self.watches.pop(rid)
        return Stall(max(0.0, w.largest - (w.typical or 0.0)), w.tag)

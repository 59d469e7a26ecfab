"""What the cell agent keeps per request it owns."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.contract.records import TokenRecord


@dataclass
class Owned:
    """A request this cell owns at `epoch`: generated tokens [flushed, flushed+len(pending))
    are not yet in the store."""

    epoch: int
    flushed: int
    pending: list[TokenRecord] = field(default_factory=list)
    finish_reason: str | None = None
    migrating: bool = False
    parked: bool = False
    """Suspended with its KV in host memory: it stays ours until it moves out."""

"""What the cell agent keeps per request it owns."""

from __future__ import annotations

import json
import os
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


SYNC_LOG_ENV = "CELLFLIP_SYNC_LOG"
"""Where a cell appends, one JSON line per token batch the scheduler accepted, what it sent and
when (a post-mortem record, and the fault campaign's view of ownership from the cells' side)."""


def log_accepted(cell_id: str, sent_at: float, batches: list, rejected: set[str]) -> None:
    """Appends the accepted batches of one sync to the sync log, when one is configured.
    `sent_at`: wall-clock time the sync was sent (comparable across a machine's processes)."""
    path = os.environ.get(SYNC_LOG_ENV)
    if not path:
        return
    lines = [json.dumps({"cell": cell_id, "request": b.request_id, "epoch": b.epoch, "start": b.start,
                         "n": len(b.records), "sent": sent_at})
             for b in batches if b.request_id not in rejected and len(b.records)]
    if lines:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")

"""What both sides of a migration share: outcomes, cancellation, warm receive buffers (the
messages they exchange: messages.py)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cells.engine.base import KVHandover
from scheduler.contract.protocol import MigrationEvent

OnEngine = Callable[[Callable[[KVHandover], Any]], Any]
"""`on_engine(fn)` runs `fn(engine)` on the cell's engine (as a KVHandover) between two steps."""
Quiesce = Callable[[], contextlib.AbstractContextManager]
"""`with quiesce():` pauses this cell's decoding for the block (bounded by the agent)."""

CHUNK_BYTES = 4 << 20
"""Largest KV message of a copy round: bounds how long one export holds the engine lock and,
on cells that pause decoding for a copy message (`copy_quiesce`), how long one pause lasts
(the engine steps once between two messages): a few ms at loopback rates, so a stream feels a
copy round as slightly slower tokens, not as one long gap. At 16 MB a loaded 2-core machine
stretched single pauses to 70-87 ms (`bench/migration.py`'s worst gaps at 8k-16k, all in the
copy rounds); at 4 MB the worst was 30 / 46 ms, the move itself taking longer (355 / 898 ms).
On a GPU cell (no quiesce) a 4 MB NCCL message costs ~0.2 ms at 25 GB/s plus ~20 us launch."""

CANCELLED = "cancelled by the scheduler"


class Cancelled(Exception):
    """The scheduler cancelled the migration (`cancel_migration`); raised at the next step."""


class Cancellable:
    """A migration side that the scheduler may cancel from another thread: the flag is read
    between the steps of the transfer (a transfer op in flight ends on its own, or on the
    peer's abort, within the op timeout)."""

    def __init__(self) -> None:
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled(CANCELLED)


class StagingBuffers:
    """Receive buffers for KV copy rounds, kept for the next round. A fresh buffer is
    page-faulted in while the bytes arrive, which halves a receive's rate on a CPU cell
    (loopback gloo: about 4 GB/s into a warm buffer, 2 into a fresh one). At most `keep`
    buffers are kept; `prealloc_numel` floats are faulted in up front. Buffers are float32
    storage that a round of another dtype (a bf16 KV pool's) is received into as a view.
    `pinned` (default: when this process has initialised CUDA, i.e. its engine is on a GPU;
    a CPU cell never creates a CUDA context for it) makes fresh buffers page-locked: the host
    staging a GPU destination copies from at the link's rate."""

    def __init__(self, prealloc_numel: int = 0, keep: int = 4, pinned: bool | None = None) -> None:
        self.pinned = torch.cuda.is_initialized() if pinned is None else pinned
        self._free: list[torch.Tensor] = [self._new(prealloc_numel).zero_()] if prealloc_numel > 0 else []
        self._lock = threading.Lock()
        self.keep = keep

    def _new(self, n: int) -> torch.Tensor:
        return torch.empty(n, pin_memory=self.pinned)

    def take(self, shape: list[int], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(a tensor of `shape` and `dtype` to receive into, its backing buffer for `give`)."""
        elem = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * elem
        n = -(-nbytes // 4)  # float32 elements of backing
        with self._lock:  # by position: `==` on tensors compares elements
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = self._new(n)
        return buf[:n].view(torch.uint8)[:nbytes].view(dtype).view(shape), buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    def sizes(self) -> list[int]:
        """Numels of the kept buffers (tests, diagnostics)."""
        with self._lock:
            return sorted(b.numel() for b in self._free)


@dataclass
class Outcome:
    """What the agent needs to know when a migration thread ends."""

    request_id: str
    migration_id: str
    role: str  # "source" | "destination"
    result: str  # committed | aborted | refused | failed
    epoch: int | None = None
    num_generated: int = 0
    """Destination: generated tokens at the commit. Source: generated tokens it had synced to
    the store when it stopped (its client's stream came from the source up to there)."""
    bytes: int = 0
    reason: str = ""
    transfer_s: float = 0.0
    """Wall time spent inside KV tensor sends (source) — what the link bandwidth bounds."""
    total_s: float = 0.0
    """From the command to the outcome."""
    marks: dict = field(default_factory=dict)
    """Wall-clock instants of the stop-and-copy steps (for post-mortems and the bench)."""
    sends: list = field(default_factory=list)
    """One `[wall instant, bytes]` per KV message, in order: when the source began sending it
    (the receive was posted), or when the destination had all of it. Paired by position, the
    two give each message's time on the link to the point where the receiver has the bytes."""


def migration_event(o: Outcome) -> MigrationEvent:
    return MigrationEvent(migration_id=o.migration_id, outcome=o.result, path="kv", bytes=o.bytes)

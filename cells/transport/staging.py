"""Warm staging buffers for received weight versions.

A received version lands in one flat byte buffer (`FlatVersion`); its tensors are views of it,
and an engine that serves the version keeps some of those views for as long as it holds the
version. A fresh 400 MB buffer per version costs a page fault and a zeroed page per 4 KiB on
first touch, and an unmap when it goes, on the same cores that decode; a warm buffer costs
neither. `StagingBuffers` keeps a few and hands one out again once nothing outside it refers
to its memory any more (the storage's reference count: every view, and every tensor derived
from one without a copy, holds a reference), so a version still held by the engine, or still
in flight on a timed-out collective, is never overwritten.
"""

from __future__ import annotations

import threading

import torch

from cells.transport.buckets import FlatVersion, Manifest

WARM_BUFFERS = 2
"""Buffers kept: the version served and the one being received. A cell that holds more
versions at once (kept for scoring) receives the extra ones into fresh buffers."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _uses(t: torch.Tensor) -> int | None:
    """References to `t`'s storage, or None where this torch cannot tell."""
    if _use_count is None:
        return None
    try:
        return int(_use_count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None


def _own_uses() -> int | None:
    """The count a buffer referenced by nothing but its own tensor shows (calibrated once)."""
    return _uses(torch.empty(1, dtype=torch.uint8))


_OWN = _own_uses()


class StagingBuffers:
    """Up to `max_buffers` warm flat buffers, reused across versions. Thread-safe."""

    def __init__(self, max_buffers: int = WARM_BUFFERS) -> None:
        self.max_buffers = max_buffers
        self._bufs: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.num_reused = 0
        """Buffers handed out warm."""
        self.num_allocated = 0
        """Buffers handed out fresh (first use, none free, or a different size)."""

    def take(self, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A uint8 tensor of `nbytes` bytes on `device` that nothing else refers to: a view of
        a free warm buffer where there is one, else freshly allocated (and kept warm while
        there is room). Its content is whatever was there before."""
        device = torch.device(device)
        with self._lock:
            if _OWN is not None:
                for i, buf in enumerate(self._bufs):
                    if _uses(buf) != _OWN:
                        continue  # still referenced: a held version, or bytes still in flight
                    if buf.numel() == nbytes and buf.device == device:
                        self.num_reused += 1
                        return buf[:nbytes]  # a view: it holds the buffer until dropped
                    del self._bufs[i]  # free but of another size: make room for this one
                    break
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.num_allocated += 1
            if _OWN is not None and len(self._bufs) < self.max_buffers:
                self._bufs.append(buf)
            return buf[:nbytes]

    def flat(self, manifest: Manifest, device: str | torch.device = "cpu") -> FlatVersion:
        """An empty `FlatVersion` of `manifest` in a warm buffer where one is free."""
        return FlatVersion(manifest, self.take(manifest.total_bytes, device))


def empty_flat(buffers: StagingBuffers | None, manifest: Manifest, device) -> FlatVersion:
    """Where a received version's bytes land: a warm buffer from `buffers`, or a fresh one."""
    return buffers.flat(manifest, device) if buffers is not None else FlatVersion.empty(manifest, device)


class FlatReceipt:
    """What a broadcast's split receive hands back: the unpacker's surface (`is_verified`,
    `bad`, `staging`) over a flat buffer."""

    def __init__(self, flat: FlatVersion, staging: dict[str, torch.Tensor] | None) -> None:
        self.flat, self.given, self.bad, self.num_unpacked = flat, staging, [], 0
        self.staging: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] | None = None

    @property
    def is_verified(self) -> bool:
        return not self.bad and self.num_unpacked == self.flat.manifest.num_buckets

    def prepare(self) -> None:
        """Builds the tensor views while the bytes are still in flight (they do not depend
        on the content), so that `finish` after the last bucket costs next to nothing. A
        tensor at an unaligned offset is a copy, taken in `finish` once every byte is in."""
        if self._views is None:
            self._views = self.flat.tensors(aligned_only=True)

    def finish(self) -> None:
        self.prepare()
        if len(self._views) < len(self.flat.manifest.tensors):
            self._views = self.flat.tensors()  # the copies, now that every op has arrived
        if self.given is None:
            self.staging = self._views
            return
        for name, t in self._views.items():
            if self.is_verified:
                self.given[name].copy_(t)
        self.staging = self.given

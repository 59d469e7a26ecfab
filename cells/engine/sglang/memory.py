"""GPU memory handed to the training role and taken back, for SGLang cells.

Memory handover, one line each:
  to training: (no request left) → release(weights, kv_cache) → pause
  to rollout:  resume(weights) → install the version that arrived meanwhile → resume(kv_cache)
               → continue
A version that arrives while the weights' memory is released is kept in host memory
(`defer`) and installed at the flip back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from cells.engine.records import EngineError
from cells.engine.sglang import backend as sb
from cells.engine.sglang.serving import Serving
from cells.engine.sglang.streams import RequestStreams
from cells.engine.sglang.update import WeightUpdate
from cells.engine.sglang.weights import TensorMeta, check_against_manifest

log = logging.getLogger(__name__)

ROLE_TAGS = ("weights", "kv_cache")
"""GPU memory handed to the training role and back."""


class MemoryHandover:
    """Releases SGLang's GPU memory to training and takes it back (`enter_role`)."""

    def __init__(self, serving: Serving, streams: RequestStreams, update: WeightUpdate, *,
                 cpu_backup: bool, transfer_timeout_s: float) -> None:
        self.serving, self.streams, self.update = serving, streams, update
        self.runtime = serving.runtime
        self.cpu_backup = cpu_backup
        """`enable_weights_cpu_backup`: released weights come back as they were."""
        self.transfer_timeout_s = transfer_timeout_s

    def release(self, tags: Iterable[str] = ROLE_TAGS) -> None:
        """Hand GPU memory to the training role. Only with no request left and every aborted
        SGLang stream ended (drain first, release after): SGLang asserts idleness inside its
        scheduler, a crash rather than an error. Released weights (without
        `enable_weights_cpu_backup`) come back empty, so the next version received must be
        complete."""
        tags = check_tags(tags)
        if self.streams.has_work():
            raise EngineError("requests remain on this cell; migrate them out before releasing memory")
        if self.runtime.wait_streams(self.transfer_timeout_s):  # aborted ones stay until SGLang ends them
            raise EngineError(f"SGLang still holds {len(self.runtime.streams)} aborted requests")
        self.runtime.control("release_memory_occupation", tags=tags)
        self.serving.released |= set(tags)
        if "weights" in tags and not self.cpu_backup:
            self.serving.weights_valid = False

    def resume(self, tags: Iterable[str] = ROLE_TAGS) -> None:
        tags = check_tags(tags)
        released = self.serving.released
        if not set(tags) <= released:
            raise EngineError(f"cannot resume {sorted(set(tags) - released)}: not released")
        self.runtime.control("resume_memory_occupation", tags=tags)
        released -= set(tags)

    def enter_role(self, role: str) -> None:
        """Hand GPU memory over at a role flip. `training`: release weights and KV cache
        (refused while any request remains) and pause. `rollout`: resume the weights, install
        a version that arrived meanwhile, resume the KV cache, continue. Refused (memory left
        released) when there is no complete version to serve. Idempotent."""
        if role == "training":
            self._to_training()
        elif role == "rollout":
            self._to_rollout()
        else:
            raise EngineError(f"unknown role {role!r}; expected 'training' or 'rollout'")

    def _to_training(self) -> None:
        tags = [t for t in ROLE_TAGS if t not in self.serving.released]
        if tags:
            self.release(tags)
        if self.serving.mode == "serving":
            self.serving.pause_all()

    def _to_rollout(self) -> None:
        s = self.serving
        if s.deferred is None and not s.weights_valid:
            raise EngineError("no complete weight version to serve: the weights were released without "
                              "enable_weights_cpu_backup (or an update failed) and no version has arrived since")
        resumed = False
        if "weights" in s.released:
            self.resume(["weights"])
            resumed = True
        if s.deferred is not None:
            version, tensors = s.deferred
            s.deferred = None
            try:
                self.update.load_weights(version, tensors, keep_previous=True)
            except EngineError:
                if resumed:  # back to where the training role had it
                    self.release(["weights"])
                raise
        rest = [t for t in sb.GPU_MEMORY_TAGS if t in s.released]
        if rest:
            self.resume(rest)
        s.resume_all()

    def defer(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for `enter_role("rollout")`. Versions deferred one after another
        merge (in-place updates compose); a cell whose weights came back empty needs every
        tensor of the checkpoint."""
        s = self.serving
        if s.deferred is not None and version <= s.deferred[0]:
            raise EngineError(f"version {version} is not newer than version {s.deferred[0]} awaiting install")
        merged = {**(s.deferred[1] if s.deferred is not None else {}), **tensors}
        check_against_manifest([TensorMeta.of(n, t) for n, t in merged.items()], self.update.manifest,
                               require_all=not s.weights_valid)
        s.deferred = (version, merged)
        log.info("version %d kept in host memory until the cell returns to rollout", version)


def check_tags(tags: Iterable[str]) -> list[str]:
    tags = list(dict.fromkeys(tags))
    bad = [t for t in tags if t not in sb.GPU_MEMORY_TAGS]
    if not tags or bad:
        raise EngineError(f"memory tags must be among {sb.GPU_MEMORY_TAGS}, got {tags}")
    return tags

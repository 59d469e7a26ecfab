"""The scoring copy on SGLang cells (`scoring: cell_copy`).

Old log-probs need training numerics: the trainer's model implementation, a full forward
with no KV cache, not SGLang's sampler. With `cell_copy` the cell keeps such a copy of the
version it serves and fills it from the same broadcast as SGLang (one more rank in the
version's group). The default copy is the embedded engine's Qwen3 model (the code path the
trainer uses), loaded from the cell's checkpoint into host memory (4 B × parameters, fp32)
and run on the CPU: right for small models; a deployment with large ones passes its own
GPU-resident copy as `scorer=` (anything with `score` and `load_weights`), or chooses
`trainer_copy`.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from cells.engine.interface import EngineError
from cells.engine.sglang_weights import (
    BucketSpec,
    UpdateGroup,
    broadcast_bucket,
    bucket_crc32,
    join_update_group,
    unflatten_bucket,
)


class ScoringCopy(Protocol):
    """The trainer's model implementation holding the cell's version. An optional `device`
    attribute says where it wants received tensors (default: the CPU)."""

    def score(self, token_ids: list[int], *, temperature: float = 1.0) -> torch.Tensor: ...

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...


def default_scoring_copy(model_path: str, version: int) -> ScoringCopy:
    """The embedded engine's model loaded from `model_path` (no KV pool to speak of)."""
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.config import EmbeddedEngineConfig, ModelConfig

    cfg = EmbeddedEngineConfig(model=ModelConfig(preset=None, path=model_path), num_blocks=1, max_running=1)
    try:
        return EmbeddedEngine(cfg, version=version)
    except (EngineError, OSError, ValueError, KeyError) as e:
        raise EngineError(f"scoring: cell_copy could not load {model_path} into the embedded model ({e}); "
                          "pass a scoring copy (scorer=...) or configure scoring: trainer_copy") from e


class ScoringReceiver:
    """The scoring copy's rank in a version's update group, on its own thread: SGLang's
    ranks join the same collectives from its scheduler process while the cell agent's
    thread drives them. NCCL groups receive on the GPU; tensors then move to the copy."""

    def __init__(self, group: UpdateGroup, rank: int, buckets: list[BucketSpec], device, timeout_s: float):
        self._args = (group, rank, buckets, torch.device(device), timeout_s)
        self._tensors: dict[str, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scoring-copy-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        group, rank, buckets, device, timeout_s = self._args
        wire = torch.device("cuda") if group.backend == "nccl" else torch.device("cpu")
        bad: list[str] = []
        try:
            pg = join_update_group(group, rank, timeout_s)
            for b in buckets:  # receive every bucket even after a bad one: the peers wait on each
                flat = torch.empty(b.nbytes, dtype=torch.uint8, device=wire)
                broadcast_bucket(pg, flat, timeout_s)
                if b.crc32 is not None and bucket_crc32(flat) != b.crc32:
                    bad.append(b.names[0])
                self._tensors.update({k: v.to(device) for k, v in unflatten_bucket(flat, b).items()})
            if bad:
                raise EngineError(f"checksum mismatch in the buckets starting at {bad}")
        except BaseException as e:
            self._error = e

    def result(self, timeout_s: float) -> dict[str, torch.Tensor]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise EngineError("the scoring copy did not receive the version in time")
        if self._error is not None:
            raise EngineError(f"scoring copy: {self._error}") from self._error
        return self._tensors

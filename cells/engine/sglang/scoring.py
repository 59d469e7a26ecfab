"""The scoring copy on SGLang cells (`scoring: cell_copy`).

Old log-probs need training numerics: the trainer's model implementation, a full forward
with no KV cache, not SGLang's sampler. With `cell_copy` the cell keeps such a copy of the
version it serves and fills it from the same broadcast as SGLang (one more rank in the
version's group). The default copy is the embedded engine's Qwen3 model (the code path the
trainer uses), loaded from the cell's checkpoint into host memory (4 B × parameters, fp32)
and run on the CPU: right for small models; a deployment with large ones passes its own
GPU-resident copy as `scorer=` (anything with `score` and `load_weights`), or chooses
`publisher_copy`.

`ScoringVersions` keeps the cell's scoring versions: the served one and, with a copy that
holds several (the default one does), older ones until the scheduler drops them after their
final pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from cells.engine.base import Engine, VersionedWeights, scoring, versioned_weights
from cells.engine.records import EngineError
from cells.engine.sglang.weights import (
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


class ScoringVersions:
    """The versions a cell's scoring copy can score, and the scorers the log-prob service
    runs beside decoding (without the engine lock).

    A copy that is an engine with versioned weights (`Capabilities.versioned_weights`; the
    default copy, an `EmbeddedEngine`, is one) holds the served version and older ones until
    `drop`; its scorers keep their own reference to their version's weights. Any other copy
    (`score` and `load_weights` only) holds the served version only: its scorer checks, under
    a lock that a version change also takes, that the copy still holds that version, so a
    log-prob is never computed with another version's weights."""

    def __init__(self, copy: ScoringCopy, version: int) -> None:
        self.copy = copy
        self.multi = isinstance(copy, Engine) and copy.capabilities.versioned_weights
        self._versioned: VersionedWeights | None = versioned_weights(copy) if self.multi else None
        self._version = version
        """The version a single-version copy holds."""
        self._lock = threading.Lock()

    @property
    def held(self) -> list[int]:
        return sorted(self._versioned.versions_held) if self._versioned is not None else [self._version]

    def load(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool) -> None:
        """The served version became `version` (the tensors SGLang received). With
        `keep_previous` a multi-version copy keeps the one it served for scoring."""
        with self._lock:
            if self.multi:
                self.copy.load_weights(version, tensors, keep_previous=keep_previous)
            else:
                self.copy.load_weights(version, tensors)
            self._version = version

    def hold(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for scoring only (SGLang's weights do not change)."""
        if self._versioned is None:
            raise EngineError(f"the scoring copy holds one version only (it is not an engine with versioned "
                              f"weights); version {version} cannot be kept beside the served one")
        self._versioned.hold_weights(version, tensors)

    def scorer(self, version: int) -> Callable[..., torch.Tensor] | None:
        """`fn(token_ids, temperature) -> log-probs of tokens 1..L-1` under `version`, or
        None where the copy does not hold it."""
        if version not in self.held:
            return None
        if self.multi:
            return scoring(self.copy).scorer(version)

        def run(token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
            with self._lock:
                if self._version != version:
                    raise EngineError(f"version {version} left the scoring copy (it holds {self._version} now)")
                return self.copy.score(token_ids, temperature=temperature)
        return run

    def drop(self, version: int) -> None:
        """Free `version` from the copy. The version the copy serves (the cell's last
        installed one) stays until a newer one replaces it, as does a single-version copy's."""
        if self._versioned is not None and version != self._version and version in self.held:
            self._versioned.drop_version(version)


def default_scoring_copy(model_path: str, version: int) -> ScoringCopy:
    """The embedded engine's model loaded from `model_path` (no KV pool to speak of)."""
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

    cfg = EmbeddedEngineConfig(model=ModelConfig(preset=None, path=model_path), num_blocks=1, max_running=1)
    try:
        return EmbeddedEngine(cfg, version=version)
    except (EngineError, OSError, ValueError, KeyError) as e:
        raise EngineError(f"scoring: cell_copy could not load {model_path} into the embedded model ({e}); "
                          "pass a scoring copy (scorer=...) or configure scoring: publisher_copy") from e


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

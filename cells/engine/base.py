"""The engine boundary: what every engine does, and the abilities an engine may add.

Two engines sit behind it: the embedded torch engine (cells/engine/embedded/: per-request KV
hand-over, scoring with training numerics, staged weight versions) and SGLang on GPU cells
(cells/engine/sglang/: in-place weight updates through its own collective, GPU memory handed
to the training role, no per-request KV export).

`Engine` is what the cell agent calls on every engine. Each optional ability is a small
protocol below, and `Capabilities` (the engine's `capabilities`: the cell protocol's own,
scheduler/contract/protocol.py, which the cell registers with as it is) says which ones the
engine implements. Callers branch on `Capabilities` and reach an ability through its accessor
(`kv_handover(engine)`, ...), which returns the engine typed as that ability or raises
EngineError: nothing outside cells/engine/ probes an engine's attributes.

Mutating calls happen between `step()` calls, on the thread that calls `step()` (the agent's
engine lock), unless a method says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch

from cells.engine.records import EngineError, RequestSnapshot, SamplingParams, TokenEvent
from scheduler.contract.protocol import Capabilities, Summary

if TYPE_CHECKING:
    from cells.engine.sglang.weights import BucketSpec, UpdateGroup


class Engine(ABC):
    """A model replica that decodes many requests. Every engine implements this."""

    capabilities: Capabilities
    requests: Mapping[str, Any]
    """The requests this engine holds, by id (callers only read it)."""
    train_device: str = "cpu"
    """Where the cell's training rank computes (the accelerator this engine leaves to it)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Weight version currently served."""

    @abstractmethod
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    prompt_len: int | None = None, cache_key: str | None = None,
                    path: str | None = None, checked: int = 0) -> None:
        """Queue a request. `prompt_len` < len(prompt_ids) resumes a request whose tokens after
        `prompt_len` were generated elsewhere (same noise as if never moved); `cache_key`
        names the session whose earlier turns' KV may be reused; `path` says how a moved
        request came ("reprefill" | "kv_store"); `checked`: the first `checked` ids are a
        context this engine took (or sampled) before, so only the rest are checked (a sticky
        turn's held prefix: cells/agent/held.py). Raises EngineError on bad ids, a duplicate
        id or bad params."""

    @abstractmethod
    def step(self) -> list[TokenEvent]:
        """Run one engine step; return the new tokens."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running (safe without the engine lock)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request and free what it holds. Unknown ids are ignored."""

    @abstractmethod
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool = False) -> None:
        """Serve `version` from `tensors` (between steps). `keep_previous`: keep the version
        served so far for scoring where the engine can hold several. Raises EngineError on a
        name/shape mismatch."""

    @abstractmethod
    def summary(self) -> Summary:
        """The heartbeat view (the cell protocol's `Summary`; the agent adds the role and the
        versions loading)."""

    def recompute_all(self) -> int:
        """The `recompute` policy after a version change: re-prefill every running request
        under the new weights. Returns how many were dropped to recompute (default: none)."""
        return 0

    def debug_state(self) -> dict:
        """The engine's state for stall reports (read-only, without the engine lock)."""
        return self.summary().to_dict()


class KVHandover(Protocol):
    """Per-request hand-over of KV blocks (live migration) and parking in host memory.

    Source: `export_kv` copies completed blocks while the request decodes; `pause_request`
    (or `pause_after`) stops it for the stop-and-copy; `snapshot` describes it; `release`
    frees it after the commit, `unpause` continues it after an abort. Destination:
    `reserve` → `import_kv` (per round) → `import_request` (paused) → `resume_request` after
    the commit; `release` on abort. Parking: `park` moves a request's KV to host memory and
    frees its blocks; a parked request moves on later by an ordinary migration."""

    def request_length(self, request_id: str) -> tuple[int, int]: ...
    def num_complete_blocks(self, request_id: str) -> int: ...
    def num_kv_blocks(self, request_id: str) -> int: ...
    def kv_bytes_per_block(self) -> int: ...
    def kv_pool_nbytes(self) -> int: ...
    def kv_on_host(self) -> bool: ...
    def export_kv(self, request_id: str, start: int, end: int) -> torch.Tensor: ...
    def snapshot(self, request_id: str, records_from: int = 0, token_ids_from: int = 0) -> RequestSnapshot: ...
    def pause_request(self, request_id: str) -> None: ...
    def pause_after(self, request_id: str, num_tokens: int) -> None: ...
    def unpause(self, request_id: str) -> None: ...
    def is_paused(self, request_id: str) -> bool: ...
    def release(self, request_id: str) -> None: ...
    def reserve(self, request_id: str, num_tokens: int, headroom_blocks: int = 0) -> bool: ...
    def import_kv(self, request_id: str, start: int, data: torch.Tensor) -> None: ...
    def import_request(self, snap: RequestSnapshot) -> None: ...
    def resume_request(self, request_id: str) -> None: ...
    def park(self, request_id: str) -> int: ...
    def parked(self) -> list[str]: ...


class VersionedWeights(Protocol):
    """Weight versions beside the served one: prepared off the engine loop, installed by a
    swap, older ones held for scoring until dropped."""

    @property
    def versions_held(self) -> list[int]: ...
    def prepare_weights(self, tensors: dict[str, torch.Tensor]) -> Any:
        """Loader thread, beside decoding: check and prepare; the result goes to `install_prepared`."""
    def install_prepared(self, version: int, prepared: Any, *, activate: bool = True) -> None: ...
    def hold_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...
    def drop_version(self, version: int) -> None: ...


Scorer = Callable[..., torch.Tensor]
"""`fn(token_ids, temperature=1.0) -> log-probs of tokens 1..L-1` under one version."""


class Scoring(Protocol):
    """Log-probs with training numerics (a full forward, no KV cache), beside decoding."""

    def score(self, token_ids: list[int], *, temperature: float = 1.0) -> torch.Tensor: ...
    def scorer(self, version: int) -> Scorer | None:
        """A scorer for `version` that a background thread may run without the engine lock;
        None where the engine does not hold it."""


class CollectiveUpdate(Protocol):
    """Receives a version through the engine's own collective (an update group of
    `capabilities.update_ranks` ranks), paused and updated in place."""

    def receive_version(self, version: int, group: UpdateGroup, buckets: Sequence[BucketSpec | Mapping], *,
                        keep_previous: bool = False) -> None: ...


class RoleHandover(Protocol):
    """Hands the engine's accelerator memory to the training role and takes it back."""

    def enter_role(self, role: str) -> None:
        """`training` or `rollout`; idempotent; EngineError (memory as it was) if refused."""


T = TypeVar("T")


def _ability(engine: Engine, has: bool, what: str, kind: type[T]) -> T:
    if not has:
        raise EngineError(f"this engine has no {what}")
    return cast(kind, engine)


class HoldsKVHandover(Protocol):
    """An engine with `capabilities.kv_export` holds its hand-over helper as `handover`."""

    handover: KVHandover


def kv_handover(engine: Engine) -> KVHandover:
    """The engine's KVHandover helper (`engine.handover`; `capabilities.kv_export`), else EngineError."""
    return _ability(engine, engine.capabilities.kv_export, "per-request KV hand-over", HoldsKVHandover).handover


def versioned_weights(engine: Engine) -> VersionedWeights:
    """`engine` as VersionedWeights (`capabilities.versioned_weights`), else EngineError."""
    return _ability(engine, engine.capabilities.versioned_weights, "versioned weights", VersionedWeights)


def scoring(engine: Engine) -> Scoring:
    """`engine` as Scoring (`capabilities.scoring`), else EngineError."""
    return _ability(engine, engine.capabilities.scoring, "scoring", Scoring)


def collective_update(engine: Engine) -> CollectiveUpdate:
    """`engine` as a CollectiveUpdate (`capabilities.update_ranks` > 0), else EngineError."""
    return _ability(engine, engine.capabilities.update_ranks > 0, "collective weight update", CollectiveUpdate)


def role_handover(engine: Engine) -> RoleHandover:
    """`engine` as a RoleHandover (`capabilities.role_handover`), else EngineError."""
    return _ability(engine, engine.capabilities.role_handover, "role hand-over", RoleHandover)

"""Which path a migration takes, decided from what each end can do.

Paths, best first:
- `kv`: the source exports the request's KV blocks and the destination imports them
  (embedded engine on both ends; SGLang has no per-request KV export).
- `kv_store`: both ends share a hierarchical KV store (SGLang HiCache with a storage
  backend). The source stops the request, which commits its KV to the radix tree and from
  there to the store (HiCache write-through); the destination re-submits the token buffer
  and its prefix match loads the blocks from the store instead of recomputing them. A
  block the store lacks (not yet written, evicted) is recomputed, so the result is the
  same tokens, only slower.
- `reprefill`: the destination recomputes the KV from the session's token buffer.

Both KV paths need the same model and the same weight version at both ends: KV computed
under another version must never be reused (the prefix cache is salted per version for
the same reason). The planner weighs the paths with `MigrationCostModel`.
This module imports neither torch nor the engines, so the control plane can share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

MigrationPath = Literal["kv", "kv_store", "reprefill"]
MIGRATION_PATHS: tuple[MigrationPath, ...] = ("kv", "kv_store", "reprefill")


@dataclass(frozen=True)
class MigrationEndpoint:
    """What one end of a migration offers; JSON-able, published in the cell's metadata."""

    kv_export: bool
    """Per-request KV export/import."""
    kv_store: str | None
    """Identity of a shared KV store the engine reads and writes (None: none)."""
    model: str
    """Model identity; KV is only reusable between identical models."""
    version: int | None
    """Weight version served (None: no complete version loaded)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> MigrationEndpoint:
        try:
            return cls(bool(d["kv_export"]), d.get("kv_store"), str(d["model"]), d.get("version"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed migration endpoint: {e}") from None


def choose_migration_path(src: MigrationEndpoint, dst: MigrationEndpoint) -> MigrationPath:
    """The best path both ends support. Pure; the planner and the adapters share it."""
    same_kv = src.model == dst.model and src.version is not None and src.version == dst.version
    if same_kv and src.kv_export and dst.kv_export:
        return "kv"
    if same_kv and src.kv_store is not None and src.kv_store == dst.kv_store:
        return "kv_store"
    return "reprefill"


@dataclass(frozen=True)
class MigrationCostModel:
    """Seconds a migration of `num_tokens` costs on each path (for the planner to weigh).

    Defaults are placeholders of the right order for one 8-GPU node serving a ~30B model;
    a deployment measures its own."""

    prefill_tokens_per_s: float = 20_000.0
    """Re-prefill throughput of the destination."""
    kv_bytes_per_token: float = 160_000.0
    """KV bytes per token (layers × kv heads × head dim × 2 × dtype bytes)."""
    link_bytes_per_s: float = 25e9
    """Cell-to-cell transfer bandwidth (the `kv` path)."""
    store_bytes_per_s: float = 5e9
    """KV store read bandwidth into the destination (the `kv_store` path)."""
    store_hit_ratio: float = 0.9
    """Share of the prefix found in the store; the rest is recomputed."""

    def seconds(self, path: MigrationPath, num_tokens: int) -> float:
        if path not in MIGRATION_PATHS:
            raise ValueError(f"unknown migration path {path!r}; supported: {MIGRATION_PATHS}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        kv_bytes = num_tokens * self.kv_bytes_per_token
        recompute = num_tokens / self.prefill_tokens_per_s
        if path == "kv":
            return kv_bytes / self.link_bytes_per_s
        if path == "kv_store":
            hit = self.store_hit_ratio
            return hit * kv_bytes / self.store_bytes_per_s + (1.0 - hit) * recompute
        return recompute


def kv_store_identity(server_args: Mapping) -> str | None:
    """The shared-store identity implied by SGLang server args: HiCache on, with a storage
    backend. Two cells match when backend and backend config are equal; a deployment whose
    config alone does not make the store shared (a local `file` directory) names the store
    explicitly instead."""
    backend = server_args.get("hicache_storage_backend")
    if not server_args.get("enable_hierarchical_cache") or not backend:
        return None
    extra = str(server_args.get("hicache_storage_backend_extra_config") or "")
    return f"{backend}:{hashlib.sha256(extra.encode()).hexdigest()[:12]}"

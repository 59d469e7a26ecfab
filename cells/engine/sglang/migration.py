"""The migration paths, and what one end of a move offers.

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
the same reason). The scheduler's planner alone decides each move's path, weighing the
paths' costs (`scheduler.planner.destinations.move_seconds`, `LinkCostModel`) over what each cell
registered (`Capabilities.kv_export`, `kv_store`); the cell carries out the path its command
names (`start` with `path`, or `migrate_out`/`migrate_in` for `kv`). This module describes an
end (`MigrationEndpoint`, published in the engine's `metadata()`) and the shared-store
identity; it imports neither torch nor the engines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

MigrationPath = Literal["kv", "kv_store", "reprefill"]


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


def kv_store_identity(server_args: Mapping, name: str | None = None) -> str | None:
    """The shared-store identity implied by SGLang server args: HiCache on, with a storage
    backend. HiCache keys a page by the model name, the TP rank and size and the page size
    (its page hashes chain page by page), so two cells can load each other's pages only when
    all of these match as well as the store: they are part of the identity. `name` names the
    store where its backend config alone does not make it shared (a local `file` directory);
    otherwise the backend and a hash of its extra config identify it."""
    backend = server_args.get("hicache_storage_backend")
    if not server_args.get("enable_hierarchical_cache") or not backend:
        return None
    extra = str(server_args.get("hicache_storage_backend_extra_config") or "")
    store = name if name is not None else f"{backend}:{hashlib.sha256(extra.encode()).hexdigest()[:12]}"
    model = server_args.get("served_model_name") or server_args.get("model_path") or ""
    keys = f"{model}|tp{server_args.get('tp_size') or 1}|page{server_args.get('page_size') or 'default'}"
    return f"{store}|{hashlib.sha256(keys.encode()).hexdigest()[:12]}"

"""Per-request hand-over: export a request's state as JSON-able metadata plus KV tensors, and
import it on another engine.

Source side: `export_kv` copies a block range while the request keeps decoding (copy rounds
send only blocks completed since the last round); `pause_request` stops it for the
stop-and-copy; `snapshot` carries position, sampling params and only the records added since
a given index; `release` frees it after the commit, `unpause` continues it after an abort.
Parking (suspension when no cell has room): `park` copies the KV to host memory and frees the
request's blocks; a parked request never decodes here again, but every source-side call above
works on it (exports read the host copy), so it moves on by an ordinary migration.
Destination side: `reserve` → `import_kv` (per round) → `import_request` (paused) →
`resume_request`. A destination never decodes an imported request before `resume_request`,
and `release` drops it (watchdog or aborted migration).

`EmbeddedHandover` is `EmbeddedEngine`'s `KVHandover` (cells/engine/base.py): a helper the
engine holds (`engine.handover`), given the engine's request table, batcher, KV pool and model
spec, a view of its version and its prefix-cache eviction when it is built; it reads nothing
else of the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cells.engine.embedded.batcher import MIXED_KV, Batcher, Request
from cells.engine.embedded.device import to_host
from cells.engine.embedded.kv_cache import BlockPool
from cells.engine.embedded.model_spec import ModelSpec
from cells.engine.records import EngineError, RequestSnapshot


class EmbeddedHandover:
    """`KVHandover` for `EmbeddedEngine` (see the module docstring)."""

    def __init__(self, requests: dict[str, Request], pool: BlockPool, batcher: Batcher, spec: ModelSpec,
                 version: Callable[[], int], evict_one: Callable[[], bool]) -> None:
        self.requests = requests  # the engine's own table (shared, not copied)
        self.pool = pool
        self.batcher = batcher
        self.spec = spec
        self._version = version
        self.evict_one = evict_one  # the engine's prefix cache gives back a block

    # -- source -----------------------------------------------------------------------------
    def _req(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise EngineError(f"unknown request {request_id!r}")
        return req

    def request_length(self, request_id: str) -> tuple[int, int]:
        """(tokens so far, prompt length) of a request, without copying its token ids."""
        req = self._req(request_id)
        return len(req.token_ids), req.prompt_len

    def num_complete_blocks(self, request_id: str) -> int:
        """Blocks whose KV is final (every slot computed); they never change again."""
        return self._req(request_id).num_computed // self.pool.block_size

    def num_kv_blocks(self, request_id: str) -> int:
        """Blocks holding any computed KV (the last one may be partial)."""
        return self.pool.blocks_for(self._req(request_id).num_computed)

    def kv_bytes_per_block(self) -> int:
        return self.pool.bytes_per_block()

    def kv_pool_nbytes(self) -> int:
        """Bytes of the KV pool, keys and values."""
        k = self.pool.k
        return k.numel() * k.element_size() * 2

    def kv_on_host(self) -> bool:
        """The KV pool is in host memory (a CPU cell: copies share the cores with decoding)."""
        return self.pool.k.device.type == "cpu"

    def kv_dtype(self) -> torch.dtype:
        return self.pool.k.dtype

    def export_kv(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """KV of table blocks [start, end): [2, layers, n, block_size, kv_heads, head_dim], in
        host memory (a GPU pool's blocks come as a pinned host copy: the staging every
        transport can send, gloo included)."""
        req = self._req(request_id)
        if not (0 <= start <= end <= self.pool.blocks_for(req.num_computed)):
            raise EngineError(f"block range [{start}, {end}) outside computed blocks of {request_id}")
        if req.status == "parked":
            return req.parked_kv[:, :, start:end]
        return to_host(self.pool.export_blocks(request_id, start, end))

    def park(self, request_id: str) -> int:
        """Suspend a request with its KV kept in host memory and its blocks returned to the
        pool; returns the bytes parked. Idempotent. A request without KV parks with none."""
        req = self._req(request_id)
        if req.status == "parked":
            return self._parked_bytes(req)
        self.batcher.remove(req)
        n = self.pool.blocks_for(req.num_computed)
        if n > len(self.pool.tables.get(request_id, ())):
            raise EngineError(f"{request_id}: KV of {req.num_computed} tokens is not resident")
        data = self.pool.export_blocks(request_id, 0, n)  # a copy, off the pool
        req.parked_kv = data.cpu() if data.device.type != "cpu" else data
        self.pool.free(request_id)
        req.status = "parked"
        return self._parked_bytes(req)

    @staticmethod
    def _parked_bytes(req: Request) -> int:
        t = req.parked_kv
        return 0 if t is None else t.numel() * t.element_size()

    def parked(self) -> list[str]:
        return sorted(rid for rid, r in self.requests.items() if r.status == "parked")

    def pause_request(self, request_id: str) -> None:
        """Stop decoding one request, keeping its blocks (stop-and-copy). A request that had
        been preempted (no KV) is paused too: its importer re-prefills."""
        req = self._req(request_id)
        if req.status == "parked":
            return  # already still, its KV in host memory
        self.batcher.remove(req)
        req.status = "paused"

    def pause_after(self, request_id: str, num_tokens: int) -> None:
        """Pause the request once it holds `num_tokens` tokens (at once if it already does):
        the stop-and-copy that follows takes the engine lock without waiting for a step
        that would only decode a token for the tail."""
        req = self._req(request_id)
        if req.status in ("parked", "paused"):
            return
        if len(req.token_ids) >= num_tokens:
            self.pause_request(request_id)
        else:
            req.pause_at = num_tokens

    def unpause(self, request_id: str) -> None:
        """Undo `pause_request` or a pending `pause_after` (the source, after an aborted
        migration); nothing for a request that is neither (or gone)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.pause_at = None
        if req.status == "paused":
            self.resume_request(request_id)

    def is_paused(self, request_id: str) -> bool:
        """The request is here and stopped (`pause_request`, or imported and not yet resumed)."""
        req = self.requests.get(request_id)
        return req is not None and req.status == "paused"

    def snapshot(self, request_id: str, records_from: int = 0, token_ids_from: int = 0) -> RequestSnapshot:
        req = self._req(request_id)
        rel = max(records_from - req.records_base, 0)
        return RequestSnapshot(
            request_id=request_id,
            prompt_len=req.prompt_len,
            num_tokens=len(req.token_ids),
            num_computed=req.num_computed,
            params=req.params,
            version=self._version(),
            model_signature=self.spec.signature(),
            block_size=self.pool.block_size,
            records_from=req.records_base + rel,
            records=req.records[rel:],
            token_ids_from=token_ids_from,
            token_ids=req.token_ids[token_ids_from:],
            kv_version=req.kv_version if req.kv_version is not None and req.kv_version >= 0 else None,
        )

    def release(self, request_id: str) -> None:
        """Forget a request and free its blocks (source after commit; destination on abort)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.batcher.remove(req)
        self.pool.free(request_id)

    def resume_request(self, request_id: str) -> None:
        """Continue a paused request (destination after commit, or source after an abort)."""
        req = self._req(request_id)
        if req.status == "parked":
            return  # an aborted move out of the parked copy: it stays parked
        if req.status != "paused":
            raise EngineError(f"request {request_id} is {req.status}, not paused")
        req.status = "running" if req.num_computed else "waiting"
        if req.num_computed:
            self.batcher.running.append(req)
        else:
            self.batcher.waiting.appendleft(req)

    # -- destination ------------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, headroom_blocks: int = 0) -> bool:
        """Reserve blocks for `num_tokens` plus headroom, or refuse (False) without side effects."""
        if request_id in self.requests or request_id in self.pool.tables:
            raise EngineError(f"request {request_id!r} already present")
        need = self.pool.blocks_for(num_tokens) + headroom_blocks
        while not self.pool.can_allocate(need) and self.evict_one():
            pass
        if not self.pool.can_allocate(need):
            return False
        self.pool.allocate(request_id, need)
        return True

    def import_kv(self, request_id: str, start: int, data: torch.Tensor) -> None:
        expected = (2, self.spec.num_layers, data.shape[2], self.pool.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(data.shape) != expected:
            raise EngineError(f"KV blocks of shape {tuple(data.shape)} do not fit this model {expected}")
        if request_id not in self.pool.tables:
            raise EngineError(f"no reservation for {request_id!r}")
        need = start + data.shape[2]
        have = len(self.pool.tables[request_id])
        if need > have:
            if not self.pool.can_allocate(need - have):
                raise EngineError(f"{request_id}: out of KV blocks while importing")
            self.pool.allocate(request_id, need - have)
        # A host (staging) tensor is copied to the pool's device here, in the pool's dtype.
        self.pool.import_blocks(request_id, start, data.to(device=self.pool.k.device, dtype=self.pool.k.dtype))

    def import_request(self, snap: RequestSnapshot) -> None:
        """Install a request whose KV has been imported, paused until `resume_request`."""
        if snap.model_signature != self.spec.signature():
            raise EngineError("request state comes from a model of a different shape")
        if snap.block_size != self.pool.block_size:
            raise EngineError(f"block size {snap.block_size} differs from this engine's {self.pool.block_size}")
        if snap.token_ids_from != 0 or len(snap.token_ids) != snap.num_tokens:
            raise EngineError("import needs the full token ids (assemble round deltas first)")
        if snap.request_id in self.requests:
            raise EngineError(f"duplicate request id {snap.request_id!r}")
        table = self.pool.tables.get(snap.request_id, [])
        if self.pool.blocks_for(snap.num_computed) > len(table):
            raise EngineError(f"{snap.request_id}: KV for {snap.num_computed} tokens not imported")
        params = snap.params
        ids = snap.token_ids
        if min(ids) < 0 or max(ids) >= self.spec.vocab_size:  # C-speed check: no per-id loop here
            raise EngineError(f"token ids outside [0, {self.spec.vocab_size})")
        req = Request(snap.request_id, ids, snap.prompt_len, params, num_computed=snap.num_computed,
                      status="paused", records_base=len(ids) - snap.prompt_len,
                      kv_version=None if not snap.num_computed else snap.kv_version
                      if snap.kv_version is not None and snap.kv_version == self._version() else MIXED_KV)
        if snap.num_computed == 0:
            self.pool.free(snap.request_id)
        self.requests[snap.request_id] = req

"""The embedded torch engine: continuous batching over a paged KV cache, per-request hand-over,
cache-free scoring with the sampler's numerics, and staged weight versions.

One step: schedule → forward → sample → postprocess.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cells.engine.base import Capabilities, Engine
from cells.engine.embedded.batcher import MIXED_KV, Batcher, Request, WorkItem
from cells.engine.embedded.checkpoint import load_checkpoint
from cells.engine.embedded.device import pool_blocks, resolve_device, resolve_dtype
from cells.engine.embedded.handover import EmbeddedHandover
from cells.engine.embedded.kv_cache import BlockPool, PagedSink
from cells.engine.embedded.layers import probe_tiles, rope_tables
from cells.engine.embedded.model import (
    Prepared,
    Segment,
    check_weights,
    forward,
    init_weights,
    output_logprobs,
    prepare,
    token_logprobs,
)
from cells.engine.embedded.model_spec import ModelSpec, resolve_spec
from cells.engine.embedded.sampling import sample
from cells.engine.records import EngineError, SamplingParams, TokenEvent, TokenRecord
from scheduler.contract.config.engine import EmbeddedEngineConfig
from scheduler.contract.protocol import Summary


@dataclass(slots=True)
class CachedPrefix:
    owner: str
    token_ids: list[int]
    version: int


class EmbeddedEngine(Engine):
    def __init__(self, cfg: EmbeddedEngineConfig | None = None, *, spec: ModelSpec | None = None,
                 weights: dict[str, torch.Tensor] | None = None, version: int = 0):
        cfg = cfg or EmbeddedEngineConfig()
        self.cfg = cfg
        self.spec = spec or resolve_spec(cfg.model)
        self.device, self.dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
        if weights is None:  # made tensor by tensor on the device, in the dtype
            weights = (load_checkpoint(cfg.model.path, self.spec, self.dtype, self.device) if cfg.model.path
                       else init_weights(self.spec, cfg.model.seed, device=self.device, dtype=self.dtype))
        check_weights(self.spec, weights)
        self.tile: int | None = None
        if cfg.batch_invariant:
            # The tiles fix every kernel's shape; the probe checks that a row does not depend
            # on its neighbours. Single rows are the fallback that needs no such assumption.
            self.tile = cfg.row_tile if probe_tiles(self.spec, cfg, self.device, self.dtype) else 1
        self._rope = tuple(t.to(device=self.device, dtype=self.dtype) for t in
                           rope_tables(self.spec.head_dim, self.spec.max_position, self.spec.rope_theta))
        self._versions: dict[int, Prepared] = {version: prepare(self.spec, self._place(weights), self._rope)}
        self._version = version
        num_blocks = pool_blocks(cfg.num_blocks, self.device, BlockPool.block_bytes(self.spec, cfg.block_size, self.dtype),
                                 cfg.kv_memory_fraction)
        self.pool = BlockPool(self.spec, num_blocks, cfg.block_size, self.dtype, self.device)
        self.batcher = Batcher(self.pool, cfg.max_running, cfg.prefill_chunk)
        self.requests: dict[str, Request] = {}
        # Prefix cache: a finished request's KV stays, keyed by its session, until a later turn
        # of the same session extends it (KV reuse across turns) or the blocks are needed.
        self.prefix_cache: OrderedDict[str, CachedPrefix] = OrderedDict()
        self.batcher.evict = self.evict_one
        self.handover = EmbeddedHandover(self.requests, self.pool, self.batcher, self.spec,
                                         lambda: self.version, self.evict_one)
        self.num_cached_tokens = 0
        """Prompt tokens whose KV came from the prefix cache instead of a prefill."""
        ranges = self.spec.output_id_ranges
        self.capabilities = Capabilities(kv_export=True, scoring=True, weight_update="staged",
                                         batch_invariant=cfg.batch_invariant, versioned_weights=True,
                                         block_size=cfg.block_size, vocab_size=self.spec.vocab_size,
                                         max_context=min(self.spec.max_position, num_blocks * cfg.block_size),
                                         output_ranges=tuple(tuple(r) for r in ranges) if ranges else None)
        self.num_steps = 0

    # -- versions ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def versions_held(self) -> list[int]:
        return sorted(self._versions)

    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        return self._prepared(version).weights

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool = False) -> None:
        """Activate `version` (call between steps). The previous version stays available for
        scoring when `keep_previous` until `drop_version`."""
        check_weights(self.spec, tensors)
        prep = prepare(self.spec, self._place(tensors), self._rope)
        if not keep_previous:
            self._versions.clear()
        self._versions[version] = prep
        self._version = version

    def prepare_weights(self, tensors: dict[str, torch.Tensor]) -> Prepared:
        """Check and prepare a version's weights without touching the engine's state, so a
        loader thread can do it beside decoding; `install_prepared` then only swaps it in."""
        check_weights(self.spec, tensors)
        return prepare(self.spec, self._place(tensors), self._rope)

    def install_prepared(self, version: int, prep: Prepared, *, activate: bool = True) -> None:
        """Between steps: serve `prep` as `version` (older versions stay for scoring until
        `drop_version`), or with `activate=False` hold it for scoring only."""
        self._versions.setdefault(version, prep)
        if activate:
            self._version = version

    def hold_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for scoring only (the served version does not change)."""
        check_weights(self.spec, tensors)
        if version not in self._versions:
            self._versions[version] = prepare(self.spec, self._place(tensors), self._rope)

    def _place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A version's tensors on the engine's device in its dtype, one at a time (tensors
        already there, contiguous, are used as they are: no copy)."""
        return {k: t.detach().to(device=self.device, dtype=self.dtype).contiguous() for k, t in tensors.items()}

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def scorer(self, version: int):
        """`fn(token_ids, temperature) -> log-probs of tokens 1..L-1` with `version`'s weights,
        independent of later engine calls (it keeps its own reference to the weights), so a
        background thread may run it beside decoding without the engine lock."""
        prep, tile = self._prepared(version), self.tile

        def run(token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
            ids = self._ids(self._check_ids(token_ids))
            with torch.no_grad():
                return token_logprobs(prep, ids, temperature, tile)
        return run

    def drop_version(self, version: int) -> None:
        if version == self._version:
            raise EngineError(f"cannot drop the served version {version}")
        self._versions.pop(version, None)

    def _prepared(self, version: int | None) -> Prepared:
        v = self._version if version is None else version
        if v not in self._versions:
            raise EngineError(f"version {v} is not held by this engine (holds {self.versions_held})")
        return self._versions[v]

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    *, prompt_len: int | None = None, cache_key: str | None = None, path: str | None = None,
                    checked: int = 0) -> None:
        """Queue a request. `prompt_len` < len(prompt_ids) resumes a request whose tokens after
        `prompt_len` were already generated (re-prefill elsewhere): generation continues at
        generated index len(prompt_ids) - prompt_len, with the same noise as if never moved.
        `cache_key`: the session, whose cached prefix is reused. `path` is not used: a moved
        request re-prefills here whichever way it came (this engine shares no KV store).
        `checked`: the first `checked` ids were taken by this engine before (a held prefix),
        only the rest are checked."""
        if request_id in self.requests:
            raise EngineError(f"duplicate request id {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be SamplingParams")
        ids = self._check_ids(prompt_ids, checked)
        plen = len(ids) if prompt_len is None else prompt_len
        if not (1 <= plen <= len(ids)):
            raise EngineError(f"prompt_len {prompt_len} outside [1, {len(ids)}]")
        total = plen + params.max_tokens
        if total > self.spec.max_position:
            raise EngineError(f"prompt plus max_tokens = {total} exceeds max_position {self.spec.max_position}")
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise EngineError(f"request needs {self.pool.blocks_for(total)} KV blocks, the pool has {self.pool.num_blocks}")
        req = Request(request_id, ids, plen, params, records_base=len(ids) - plen, cache_key=cache_key)
        if req.num_generated >= params.max_tokens:
            raise EngineError(f"request already has {req.num_generated} >= max_tokens generated tokens")
        self._reuse_prefix(req)
        self.requests[request_id] = req
        self.batcher.waiting.append(req)

    def _check_ids(self, ids: list[int], checked: int = 0) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise EngineError("token ids must be a non-empty list of ints")
        if 0 < checked < len(ids) and isinstance(ids, list):
            self._check_ids(ids[checked:])  # the held prefix was checked when this engine took it
            return ids
        if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.spec.vocab_size:
            return list(ids)  # the common case, checked at C speed (a 128k-token context: ~1 ms, not ~15)
        out = []
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.spec.vocab_size):
                raise EngineError(f"token id {t!r} outside [0, {self.spec.vocab_size})")
            out.append(t)
        return out

    def has_work(self) -> bool:
        return self.batcher.has_work()

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.batcher.remove(req)
            self.pool.free(request_id)

    def num_inflight(self) -> int:
        return sum(r.status != "parked" for r in self.requests.values())

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        items = self.batcher.schedule()
        if not items:
            return []
        logprobs = self._run(items)
        self.num_steps += 1
        return self._postprocess(items, logprobs)

    def _run(self, items: list[WorkItem]) -> torch.Tensor:
        """Forward the scheduled tokens; log-probs [num sampling items, V_out]."""
        prep = self._versions[self._version]
        ids, pos, segs, rows, temps = [], [], [], [], []
        offset = 0
        for it in items:
            n = it.end - it.start
            ids.extend(it.req.token_ids[it.start : it.end])
            pos.extend(range(it.start, it.end))
            segs.append(Segment(offset, n, it.start, PagedSink(self.pool, it.req.request_id, it.start, it.end)))
            offset += n
            if it.samples:
                rows.append(offset - 1)
                temps.append(it.req.params.temperature)
        with torch.no_grad():
            hidden = forward(prep, self._ids(ids), self._ids(pos), segs, self.tile)
            for it in items:
                it.req.num_computed = it.end
                kv = it.req.kv_version  # the version change mid-request (`continue`): mixed KV
                it.req.kv_version = self._version if kv is None or kv == self._version else MIXED_KV
            if not rows:
                return torch.empty(0)
            temps_t = torch.tensor(temps, dtype=torch.float32, device=self.device)
            return output_logprobs(prep, hidden[self._ids(rows)], temps_t, self.tile)

    def _postprocess(self, items: list[WorkItem], logprobs: torch.Tensor) -> list[TokenEvent]:
        prep = self._versions[self._version]
        events = []
        row = 0
        for it in items:
            if not it.samples:
                continue
            req, lp = it.req, logprobs[row]
            row += 1
            index = req.num_generated
            out_i, logp, truncated = sample(lp, req.params, req.request_id, index)
            tok = int(prep.out_ids[out_i]) if prep.out_ids is not None else out_i
            rec = TokenRecord(tok, logp, self._version, truncated)
            req.token_ids.append(tok)
            req.records.append(rec)
            reason = None
            if tok in req.params.stop_token_ids:
                reason = "stop"
            elif req.num_generated >= req.params.max_tokens:
                reason = "length"
            if reason:
                self._finish(req)
            elif req.pause_at is not None and len(req.token_ids) >= req.pause_at:
                self.batcher.remove(req)  # the stop-and-copy finds it still, no step to wait out
                req.status, req.pause_at = "paused", None
            events.append(TokenEvent(req.request_id, index, rec, reason))
        return events

    def _finish(self, req: Request) -> None:
        req.status = "finished"
        self.batcher.remove(req)
        if req.cache_key is not None and req.num_computed > 0:
            self._cache_prefix(req)
        else:
            self.pool.free(req.request_id)
        del self.requests[req.request_id]

    # -- prefix cache (KV reuse across the turns of a session) -------------------------------
    def _cache_prefix(self, req: Request) -> None:
        old = self.prefix_cache.pop(req.cache_key, None)
        if old is not None:
            self.pool.free(old.owner)
        owner = f"cache/{req.cache_key}"
        self.pool.tables[owner] = self.pool.tables.pop(req.request_id)
        version = MIXED_KV if req.kv_version is None else req.kv_version  # never the engine's: the KV's
        self.prefix_cache[req.cache_key] = CachedPrefix(owner, req.token_ids[: req.num_computed], version)

    def _reuse_prefix(self, req: Request) -> None:
        """Adopt the session's cached blocks when their tokens prefix the new prompt (same
        weight version only: KV from an old version is never reused)."""
        hit = self.prefix_cache.pop(req.cache_key, None) if req.cache_key is not None else None
        if hit is None:
            return
        n = len(hit.token_ids)
        if hit.version != self._version or n == 0 or req.token_ids[:n] != hit.token_ids:
            self.pool.free(hit.owner)
            return
        self.pool.tables[req.request_id] = self.pool.tables.pop(hit.owner)
        req.num_computed = min(n, len(req.token_ids) - 1)  # at least one token left to compute
        req.kv_version = hit.version
        self.num_cached_tokens += req.num_computed

    def evict_one(self) -> bool:
        """Free the least recently cached prefix; False when the cache is empty."""
        if not self.prefix_cache:
            return False
        _, hit = self.prefix_cache.popitem(last=False)
        self.pool.free(hit.owner)
        return True

    def recompute_all(self) -> int:
        """Drop every request's KV so it is re-prefilled under the current weights (the
        `recompute` policy across a version change). Returns how many requests."""
        n = 0
        for req in list(self.batcher.running):
            self.batcher._preempt(req)
            n += 1
        return n

    # -- scoring ----------------------------------------------------------------------------
    def score(self, token_ids: list[int], *, temperature: float = 1.0, version: int | None = None) -> torch.Tensor:
        ids = self._ids(self._check_ids(token_ids))
        with torch.no_grad():
            return token_logprobs(self._prepared(version), ids, temperature, self.tile)

    def debug_state(self) -> dict:
        """Per-request scheduling state and the pool's owners (stall reports; read-only)."""
        return {
            "requests": {rid: {"status": r.status, "computed": r.num_computed, "tokens": len(r.token_ids)}
                         for rid, r in list(self.requests.items())},
            "waiting": [r.request_id for r in list(self.batcher.waiting)],
            "running": [r.request_id for r in list(self.batcher.running)],
            "kv_blocks_free": self.pool.num_free, "kv_blocks_total": self.pool.num_blocks,
            "kv_tables": {owner: len(blocks) for owner, blocks in list(self.pool.tables.items())},
            "version": self._version, "steps": self.num_steps,
        }

    def summary(self) -> Summary:
        cached = sum(len(self.pool.tables.get(h.owner, ())) for h in self.prefix_cache.values())
        return Summary(
            inflight=self.num_inflight(), parked=self.handover.parked(),
            kv_blocks_used=self.pool.num_used - cached,  # cached prefixes are reclaimable
            kv_blocks_cached=cached, kv_blocks_total=self.pool.num_blocks, version=self._version,
            versions_held=self.versions_held, request_ids=sorted(self.requests),
            max_running=self.cfg.max_running, block_size=self.pool.block_size)

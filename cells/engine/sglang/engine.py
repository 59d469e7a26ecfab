"""SGLang behind the engine interface, for GPU cells.

How a synchronous `step()` drives SGLang: the offline `sglang.Engine` runs its scheduler and
detokenizer in child processes and keeps an asyncio loop (`engine.loop`) in this process for
its tokenizer manager. The adapter owns that loop on the cell agent's thread. Each request
is one `async_generate(input_ids=…, return_logprob=True, stream=True)` task on it; `step()`
runs the loop until a chunk arrives or `poll_s` passes and returns what arrived as
TokenEvents. SGLang's synchronous control methods run the same loop until they finish, so
streams keep being collected during them. Decoding never waits for `step()`: the scheduler
process runs on, and between steps its outputs queue in SGLang's sockets. Every SGLang call
runs inside that loop: SGLang's synchronous control methods run it themselves, and the
tokenizer manager's `abort_request`, which sends on a `zmq.asyncio` socket that needs the
thread's running loop, is wrapped in a coroutine (`_abort_in_sglang`); called bare from the
agent's engine thread it raises "There is no current event loop in thread 'engine'".

Every token reported comes from a submission made under one weight version: an update
restarts each in-flight request (abort, resubmit the tokens seen so far with the new
version's cache salt). So a token's version is its submission's version, exactly, and
KV computed under one version is never keyed under another's salt (the radix cache is
also flushed; a HiCache store is not, hence the salt). In-flight requests are therefore
recomputed at every update on SGLang cells, whatever `versions.inflight_policy` says.
Version updates and memory handover live in `control.py`; the names the cell agent
calls (versions for scoring, role flips) in `cell.py`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from cells.engine.records import (
    Capabilities,
    Engine,
    EngineError,
    RequestSnapshot,
    SamplingParams,
    TokenEvent,
    TokenRecord,
)
from cells.engine.sglang import backend as sb
from cells.engine.sglang.cell import NO_VERSION, CellMixin
from cells.engine.sglang.control import ControlMixin
from cells.engine.sglang.migration import (
    MigrationEndpoint,
    MigrationPath,
    choose_migration_path,
    kv_store_identity,
)
from cells.engine.sglang.requests import RequestState, request_from_snapshot, snapshot_of
from cells.engine.sglang.scoring import ScoringCopy, ScoringVersions, default_scoring_copy
from cells.engine.sglang.tensor_update import TENSOR_BUCKET_BYTES, update_device
from cells.engine.sglang.weights import read_checkpoint_manifest
from scheduler.config import SGLangEngineConfig


class SGLangEngine(CellMixin, ControlMixin, Engine):
    """A GPU cell's model replica served by SGLang (see the module docstring)."""

    def __init__(self, config: SGLangEngineConfig, *, version: int = 0,
                 server_args: Mapping[str, Any] | None = None, scorer: ScoringCopy | None = None,
                 kv_store: str | None = None, max_running: int | None = None, poll_s: float = 0.01,
                 transfer_timeout_s: float = 120.0, modules: sb.SGLangModules | None = None) -> None:
        """`server_args`: extra `sglang.Engine` arguments (HiCache, page size…) over the
        config's (deterministic inference comes from `config.deterministic`). `scorer`: the scoring copy for `scoring: cell_copy` (default: the
        embedded model on the CPU, scoring.py); ignored with `trainer_copy`.
        `kv_store`: name of a shared HiCache store when its backend config alone does not
        identify it (default: the config's). `max_running`: the request slots reported to the
        scheduler (default: the config's). `modules`: SGLang's entry points (None: import the
        installed package)."""
        sb.check_environment()
        self._modules = modules if modules is not None else sb.load_sglang()
        if config.scoring == "trainer_copy":
            scorer = None
        elif scorer is None:
            scorer = default_scoring_copy(config.model_path, version)
        self.config = config
        self.server_args = sb.server_kwargs(config.model_path, config.tp, config.mem_fraction_static,
                                            {**config.server_args, **(server_args or {})},
                                            deterministic=config.deterministic)
        self.capabilities = Capabilities(
            kv_export=False, scoring=config.scoring == "cell_copy", weight_update="in_place",
            batch_invariant=bool(self.server_args.get("enable_deterministic_inference", False)))
        kv_store = kv_store if kv_store is not None else config.kv_store
        self._kv_store = kv_store_identity(self.server_args, kv_store)
        if kv_store is not None and self._kv_store is None:
            raise EngineError("kv_store names a shared store but HiCache with a storage backend is not "
                              "configured (enable_hierarchical_cache, hicache_storage_backend)")
        self._scorer = scorer
        self._scoring = ScoringVersions(scorer, version) if scorer is not None else None
        """The versions the scoring copy holds (None: `trainer_copy`)."""
        self.max_running = max_running if max_running is not None else config.max_running
        self.poll_s = poll_s
        self.transfer_timeout_s = transfer_timeout_s
        self.manifest = read_checkpoint_manifest(config.model_path)
        self.tensor_bucket_bytes = TENSOR_BUCKET_BYTES
        """Bytes per `update_weights_from_tensor` call (tensor_update.py)."""
        self._update_device = update_device(self.server_args)
        self._start_engine()
        self._rids = itertools.count()
        self._reqs: dict[str, RequestState] = {}
        self._imports: dict[str, RequestState] = {}
        self._pending: list[tuple[RequestState, TokenEvent]] = []
        self._version = version
        self._weights_valid = True
        self._released: set[str] = set()
        self._state = "serving"  # serving | paused | broken
        self._deferred: tuple[int, dict[str, torch.Tensor]] | None = None
        """A version that arrived while the weights' memory was released (cell.py)."""
        self._init_counters()
        self._label_version(version)

    def _init_counters(self) -> None:
        """What the cell reports about its moves, updates and SGLang's own view."""
        self.migrations_total: Counter[str] = Counter()
        """Migrations into this cell by path (`kv_store` | `reprefill`)."""
        self.kv_store_moves: Counter[str] = Counter()
        """`kv_store` moves by what SGLang reported on resubmission: `hit` (`cached_tokens` > 0)
        or `miss` (everything recomputed; same tokens, only slower)."""
        self.kv_store_cached_tokens = 0
        """Prompt tokens SGLang found cached for `kv_store` moves, in all."""
        self.inexact_moves = 0
        """Requests moved here whose continuation is not promised token-exact: either end without
        deterministic inference, or a source with another tp (docs/GPU.md section 8)."""
        self.engine_restarts = 0
        """SGLang restarts after a version update failed inside its group (control.py)."""
        self.version_tag_mismatches = 0
        """Tokens whose version SGLang's own spans contradict (must stay 0)."""
        self.ended_without_token: list[tuple[str, str]] = []
        """(request id, reason) of requests SGLang ended before yielding another token."""

    # -- engine interface --------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    prompt_len: int | None = None, path: MigrationPath | None = None) -> None:
        """Submit a request. `prompt_len` < len(prompt_ids) resumes a request moved here by
        the scheduler (re-prefill, or a load from a shared KV store): the tokens after
        `prompt_len` were generated elsewhere, generation continues at generated index
        len(prompt_ids) - prompt_len with the same noise, and `max_tokens` counts them too.
        `path` says how a moved request came (counted in `migrations_total`)."""
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be SamplingParams")
        if not prompt_ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in prompt_ids):
            raise EngineError("prompt_ids must be a non-empty list of non-negative ints")
        plen = len(prompt_ids) if prompt_len is None else prompt_len
        if not isinstance(plen, int) or not 1 <= plen <= len(prompt_ids):
            raise EngineError(f"prompt_len {prompt_len!r} outside [1, {len(prompt_ids)}]")
        if len(prompt_ids) - plen >= params.max_tokens:
            raise EngineError(f"request already has {len(prompt_ids) - plen} >= max_tokens generated tokens")
        req = RequestState(request_id, plen, params, list(prompt_ids), [], params.max_tokens, moved_by=path)
        self._admit(req)
        self._submit(req)
        if path is not None:
            self.migrations_total[path] += 1

    def step(self) -> list[TokenEvent]:
        if not self._pending and any(r.submitted and not r.done for r in self._reqs.values()):
            self._ready.clear()
            self._loop.run_until_complete(self._wait_ready(self.poll_s))
        else:
            self._loop.run_until_complete(asyncio.sleep(0))
        return self._deliver()

    def has_work(self) -> bool:
        # list(): the agent's sync thread asks without the engine lock
        return bool(self._pending) or any(not r.done for r in list(self._reqs.values()))

    def abort(self, request_id: str) -> None:
        self._imports.pop(request_id, None)
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self._drop(req)

    def score(self, token_ids: list[int], *, temperature: float = 1.0) -> torch.Tensor:
        if self._scorer is None:
            raise EngineError("this cell does not score (scoring: trainer_copy): a cell that can score "
                              f"fetches version {self._version} from the trainer's kept copy")
        if not self._weights_valid:
            raise EngineError("no complete weight version on this cell to score with")
        return self._scorer.score(token_ids, temperature=temperature)

    @property
    def requests(self) -> dict[str, RequestState]:
        """Requests on this cell (submitted, not yet finished and delivered)."""
        return self._reqs

    def summary(self) -> dict:
        """The cell agent's heartbeat view (every key it reads). SGLang's KV pool is not
        visible per request: the block counts are 0, which the scheduler reads as "no KV
        accounting", so placement is bounded by `max_running` request slots alone.
        `version` is None while no complete version is loaded; `versions_held` are the
        versions this cell can score; nothing is ever parked (no KV export)."""
        version = self.version
        return {"inflight": len(self._reqs), "kv_blocks_used": 0, "kv_blocks_total": 0,
                "version": None if version == NO_VERSION else version, "versions_held": self.versions_held,
                "request_ids": sorted([*self._reqs, *self._imports]), "parked": [],
                "max_running": self.max_running, "block_size": self.block_size}

    # -- migration ---------------------------------------------------------------------

    @property
    def migration_endpoint(self) -> MigrationEndpoint:
        return MigrationEndpoint(kv_export=False, kv_store=self._kv_store, model=self.config.model_path,
                                 version=self._version if self._weights_valid else None)

    def metadata(self) -> dict:
        """JSON-able description for the cell's registration and the planner."""
        return {"engine": "sglang", "sglang_version": self._modules.version,
                "capabilities": {k: getattr(self.capabilities, k) for k in
                                 ("kv_export", "scoring", "weight_update", "batch_invariant")},
                "scoring": self.config.scoring, "migration": self.migration_endpoint.to_dict(),
                "migration_paths": ["kv_store", "reprefill"] if self._kv_store else ["reprefill"],
                "num_update_ranks": self.num_update_ranks, "state": self._state,
                "released": sorted(self._released)}

    def export_request(self, request_id: str, *, records_from: int = 0) -> RequestSnapshot:
        """Stop `request_id` here and describe it for a re-prefill elsewhere. The snapshot
        holds the delivered tokens only; tokens that arrived but were not yet returned by
        `step()` were never seen by anyone and are dropped (the destination samples them
        again). Stopping aborts the SGLang request, which commits its KV to the radix tree
        and, with HiCache, to the shared store."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            raise EngineError(f"unknown request {request_id!r}")
        self._drop(req)
        return snapshot_of(req, version=self._version, model_signature=self.model_signature,
                           block_size=int(self.server_args.get("page_size") or 1), records_from=records_from)

    def import_request(self, snapshot: RequestSnapshot, token_ids: list[int] | None = None, *,
                       source: MigrationEndpoint | None = None) -> MigrationPath:
        """Accept a request moved here (nothing decodes until `resume_request`). `token_ids`
        is the session's full token buffer when the snapshot carries only a tail. Returns the
        path taken, also counted in `migrations_total`."""
        if snapshot.request_id in self._imports:
            raise EngineError(f"request {snapshot.request_id} is already being imported")
        req = request_from_snapshot(snapshot, token_ids, self.config.model_path)
        self._admit(req)
        path = choose_migration_path(source, self.migration_endpoint) if source else "reprefill"
        req.moved_by = path
        self._imports[snapshot.request_id] = req
        self.migrations_total[path] += 1
        sig = snapshot.model_signature
        if not (self.capabilities.batch_invariant and sig.get("deterministic") and sig.get("tp") == self.config.tp):
            self.inexact_moves += 1
        return path

    def resume_request(self, request_id: str) -> None:
        """Start decoding an imported request (after the scheduler recorded this cell as owner)."""
        req = self._imports.pop(request_id, None)
        if req is None:
            raise EngineError(f"no imported request {request_id!r}")
        self._admit(req)
        self._submit(req)

    @property
    def model_signature(self) -> dict:
        return {"engine": "sglang", "model": self.config.model_path, "tp": self.config.tp,
                "deterministic": self.capabilities.batch_invariant}

    # -- internals ---------------------------------------------------------------------

    def _admit(self, req: RequestState) -> None:
        if req.request_id in self._reqs:
            raise EngineError(f"duplicate request id {req.request_id!r}")
        if self._state == "broken" or not self._weights_valid:
            raise EngineError("no complete weight version loaded; the cell must receive one first")
        if self._released:
            raise EngineError(f"GPU memory {sorted(self._released)} is released to training")

    def _start_engine(self) -> None:
        """Start SGLang (its scheduler processes, and the loop this adapter drives), with the
        NCCL error mode chosen first: its processes inherit the environment."""
        sb.nccl_environment()
        self._engine = self._modules.Engine(**self.server_args)
        self._loop: asyncio.AbstractEventLoop = self._engine.loop
        self._tm = self._engine.tokenizer_manager
        self._ready = asyncio.Event()
        self._streams: set[asyncio.Task] = set()
        """Open SGLang streams, aborted ones included until SGLang ends them."""

    def _submit(self, req: RequestState) -> None:
        """(Re)submit `req` to SGLang from its delivered and seen tokens, under the current version."""
        req.input_ids = req.next_input()
        req.seen_ids = []
        req.sgl_rid = sb.submission_rid(req.request_id, next(self._rids))
        req.version = self._version
        req.submitted = True
        self._reqs[req.request_id] = req
        task = self._loop.create_task(self._consume(req, req.sgl_rid))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    async def _consume(self, req: RequestState, rid: str) -> None:
        remaining = req.max_tokens - (len(req.input_ids) - req.prompt_len)
        assert remaining >= 1, "a finished request is never submitted"
        try:
            stream = await self._engine.async_generate(
                input_ids=list(req.input_ids), return_logprob=True, stream=True, rid=rid,
                sampling_params=sb.to_sglang_sampling(req.params, req.request_id, remaining),
                cache_salt=sb.cache_salt(req.version))
            async for chunk in stream:
                if req.sgl_rid == rid and not req.dropped:
                    self._on_chunk(req, chunk)
        except Exception as e:  # SGLang refused or failed the request: it ends here
            if req.sgl_rid == rid and not req.dropped and not req.done:
                self._end_without_token(req, f"SGLang error: {e}")

    def _on_chunk(self, req: RequestState, chunk: Mapping) -> None:
        meta = chunk["meta_info"]
        if req.moved_by == "kv_store":  # the first chunk of the move's submission: did the store serve?
            req.moved_by = None
            cached = sb.cached_tokens(meta) or 0
            self.kv_store_moves["hit" if cached > 0 else "miss"] += 1
            self.kv_store_cached_tokens += cached
        pairs = sb.new_tokens(chunk, len(req.seen_ids))
        reason = sb.finish_reason(meta)
        truncated = sb.is_truncated(req.params)
        base = req.num_generated_seen
        for j, (tok, lp) in enumerate(pairs):
            event = TokenEvent(req.request_id, base + j, TokenRecord(tok, lp, req.version, truncated),
                               reason if j == len(pairs) - 1 else None)
            self._pending.append((req, event))
        req.seen_ids.extend(tok for tok, _ in pairs)
        if reason is not None:
            req.done = True
            spans = sb.span_versions(meta)
            if spans:
                self.version_tag_mismatches += sum(
                    max(0, min(e, len(req.seen_ids)) - s) for s, e, v in spans if v != req.version)
            if not pairs:  # the end came after the last token: put it on that token if undelivered
                last = next((e for r, e in reversed(self._pending) if r is req), None)
                if last is not None:
                    last.finish_reason = reason
                else:
                    self._end_without_token(req, str(meta.get("finish_reason")))
        self._ready.set()

    def _end_without_token(self, req: RequestState, reason: str) -> None:
        req.done = True
        self.ended_without_token.append((req.request_id, reason))
        if not any(r is req for r, _ in self._pending) and self._reqs.get(req.request_id) is req:
            del self._reqs[req.request_id]
        self._ready.set()

    async def _wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _deliver(self) -> list[TokenEvent]:
        pending, self._pending = self._pending, []
        out = []
        for req, event in pending:
            if req.dropped or self._reqs.get(req.request_id) is not req:
                continue
            req.token_ids.append(event.record.token_id)
            req.records.append(event.record)
            out.append(event)
            if event.finish_reason is not None:
                del self._reqs[req.request_id]
        for rid, req in list(self._reqs.items()):  # ended by an error after its last token
            if req.done and req.submitted:
                del self._reqs[rid]
        return out

    def _drop(self, req: RequestState) -> None:
        req.dropped = True
        self._pending = [(r, e) for r, e in self._pending if r is not req]
        if req.submitted and not req.done:
            self._abort_in_sglang(req.sgl_rid)

    def _abort_in_sglang(self, rid: str) -> None:
        """SGLang's `abort_request` is synchronous but sends on a `zmq.asyncio` socket, whose
        send needs the thread's running loop: run it inside ours (module docstring)."""
        async def send() -> None:
            self._tm.abort_request(rid=rid)

        self._loop.run_until_complete(send())

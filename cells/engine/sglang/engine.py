"""SGLang behind the engine boundary, for GPU cells.

`SGLangEngine` is the engine the cell agent holds; it composes the adapter's parts, each of
which owns its state:
- runtime.py: SGLang's processes and the asyncio loop they are driven with (every SGLang call);
- streams.py: requests, their SGLang streams, and delivery as TokenEvents from `step()`;
- serving.py: the version served, whether SGLang decodes, the memory lent to training;
- update.py: versions into SGLang in place (an update group, or tensors in this process);
- memory.py: GPU memory handed to the training role and back (`enter_role`);
- scoring.py: the scoring copy (`scoring: cell_copy`) and the versions it holds.

Abilities (cells/engine/base.py): versioned weights (the served version in SGLang, older ones
in the scoring copy until dropped), scoring (with a scoring copy), collective updates
(`update_ranks` = tp, plus the scoring copy), role hand-over. No per-request KV export: a
moved request re-prefills here, or loads its prefix from a shared KV store (`add_request`
with `path`).

Every token reported comes from a submission made under one weight version: an update
restarts each in-flight request (abort, resubmit the tokens seen so far with the new
version's cache salt). So a token's version is its submission's version, exactly, and
KV computed under one version is never keyed under another's salt (the radix cache is
also flushed; a HiCache store is not, hence the salt). In-flight requests are therefore
recomputed at every update on SGLang cells, whatever `versions.inflight_policy` says.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cells.engine.base import Capabilities, Engine, Scorer
from cells.engine.records import EngineError, SamplingParams, TokenEvent
from cells.engine.sglang import backend as sb
from cells.engine.sglang.memory import ROLE_TAGS, MemoryHandover
from cells.engine.sglang.migration import MigrationEndpoint, MigrationPath, kv_store_identity
from cells.engine.sglang.requests import RequestState
from cells.engine.sglang.runtime import SGLangRuntime
from cells.engine.sglang.scoring import ScoringCopy, ScoringVersions, default_scoring_copy
from cells.engine.sglang.serving import NO_VERSION, Serving
from cells.engine.sglang.streams import RequestStreams
from cells.engine.sglang.update import WeightUpdate
from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    UpdateGroup,
    check_against_manifest,
    read_checkpoint_manifest,
)
from scheduler.contract.config.engine import SGLangEngineConfig
from scheduler.contract.protocol import Summary


class SGLangEngine(Engine):
    """A GPU cell's model replica served by SGLang (see the module docstring)."""

    def __init__(self, config: SGLangEngineConfig, *, version: int = 0,
                 server_args: Mapping[str, Any] | None = None, scorer: ScoringCopy | None = None,
                 kv_store: str | None = None, max_running: int | None = None, poll_s: float = 0.01,
                 transfer_timeout_s: float = 120.0, modules: sb.SGLangModules | None = None) -> None:
        """`server_args`: extra `sglang.Engine` arguments (HiCache, page size…) over the
        config's (deterministic inference comes from `config.deterministic`). `scorer`: the
        scoring copy for `scoring: cell_copy` (default: the embedded model on the CPU,
        scoring.py); ignored with `publisher_copy`. `kv_store`: name of a shared HiCache store
        when its backend config alone does not identify it (default: the config's).
        `max_running`: the request slots reported to the scheduler (default: the config's).
        `modules`: SGLang's entry points (None: import the installed package)."""
        sb.check_environment()
        modules = modules if modules is not None else sb.load_sglang()
        if config.scoring == "publisher_copy":
            scorer = None
        elif scorer is None:
            scorer = default_scoring_copy(config.model_path, version)
        self.config = config
        self.server_args = sb.server_kwargs(config.model_path, config.tp, config.mem_fraction_static,
                                            {**config.server_args, **(server_args or {})},
                                            deterministic=config.deterministic)
        kv_store = kv_store if kv_store is not None else config.kv_store
        self._kv_store = kv_store_identity(self.server_args, kv_store)
        if kv_store is not None and self._kv_store is None:
            raise EngineError("kv_store names a shared store but HiCache with a storage backend is not "
                              "configured (enable_hierarchical_cache, hicache_storage_backend)")
        self._scorer = scorer
        self.scoring_versions = ScoringVersions(scorer, version) if scorer is not None else None
        """The versions the scoring copy holds (None: `publisher_copy`)."""
        self.max_running = max_running if max_running is not None else config.max_running
        self.manifest = read_checkpoint_manifest(config.model_path)
        self.runtime = SGLangRuntime(modules, self.server_args)
        self.streams = RequestStreams(self.runtime, poll_s)
        self.serving = Serving(self.runtime, version)
        self.update = WeightUpdate(self.serving, self.streams, self.scoring_versions, tp=config.tp,
                                   manifest=self.manifest, transfer_timeout_s=transfer_timeout_s)
        self.memory = MemoryHandover(self.serving, self.streams, self.update, transfer_timeout_s=transfer_timeout_s,
                                     cpu_backup=bool(self.server_args.get("enable_weights_cpu_backup")))
        self.migrations_total: Counter[str] = Counter()
        """Requests moved into this cell by path (`kv_store` | `reprefill`)."""
        self.capabilities = Capabilities(
            kv_export=False, scoring=scorer is not None, weight_update="in_place",
            batch_invariant=bool(self.server_args.get("enable_deterministic_inference", False)),
            versioned_weights=True, role_handover=True, update_ranks=self.update.num_ranks,
            kv_store=self._kv_store, block_size=self.block_size)
        self.runtime.label_version(version)

    # -- every engine -----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version this cell serves, or will serve once back in rollout (one received
        while its weights' memory was released); `NO_VERSION` if none."""
        return self.serving.served

    @property
    def requests(self) -> dict[str, RequestState]:
        """Requests on this cell (submitted, not yet finished and delivered)."""
        return self.streams.reqs

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    prompt_len: int | None = None, cache_key: str | None = None,
                    path: MigrationPath | None = None, checked: int = 0) -> None:
        """Submit a request. `prompt_len` < len(prompt_ids) resumes a request moved here by
        the scheduler (re-prefill, or a load from a shared KV store): the tokens after
        `prompt_len` were generated elsewhere, generation continues at generated index
        len(prompt_ids) - prompt_len with the same noise, and `max_tokens` counts them too.
        `path` says how a moved request came (counted in `migrations_total`). `cache_key` is
        not needed: SGLang's radix cache finds a session's earlier turns by their tokens.
        `checked`: ids before it were checked when first taken (a held prefix)."""
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be SamplingParams")
        fresh = prompt_ids[checked:] if 0 < checked < len(prompt_ids) else prompt_ids
        if not prompt_ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in fresh):
            raise EngineError("prompt_ids must be a non-empty list of non-negative ints")
        plen = len(prompt_ids) if prompt_len is None else prompt_len
        if not isinstance(plen, int) or not 1 <= plen <= len(prompt_ids):
            raise EngineError(f"prompt_len {prompt_len!r} outside [1, {len(prompt_ids)}]")
        if len(prompt_ids) - plen >= params.max_tokens:
            raise EngineError(f"request already has {len(prompt_ids) - plen} >= max_tokens generated tokens")
        self._admit(request_id)
        self.streams.submit(RequestState(request_id, plen, params, list(prompt_ids), [], params.max_tokens,
                                         moved_by=path), self.serving.version)
        if path is not None:
            self.migrations_total[path] += 1

    def _admit(self, request_id: str) -> None:
        s = self.serving
        if request_id in self.streams.reqs:
            raise EngineError(f"duplicate request id {request_id!r}")
        if s.mode == "broken" or not s.weights_valid:
            raise EngineError("no complete weight version loaded; the cell must receive one first")
        if s.released:
            raise EngineError(f"GPU memory {sorted(s.released)} is released to training")

    def step(self) -> list[TokenEvent]:
        return self.streams.step()

    def has_work(self) -> bool:
        return self.streams.has_work()

    def abort(self, request_id: str) -> None:
        self.streams.abort(request_id)

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool = False) -> None:
        """Update in place from tensors in this process (update.py)."""
        self.update.load_weights(version, tensors, keep_previous=keep_previous)

    def recompute_all(self) -> int:
        """The `recompute` policy after an update: nothing left to do, since every update
        already re-submits each in-flight request under the new version (its KV is
        recomputed by SGLang). Returns the requests re-prefilled by this call: 0."""
        return 0

    def summary(self) -> Summary:
        """The cell agent's heartbeat view. SGLang's KV pool is not visible per request: the
        block counts are 0, which the scheduler reads as "no KV accounting", so placement is
        bounded by `max_running` request slots alone. `version` is None while no complete
        version is loaded; `versions_held` are the versions this cell can score; nothing is
        ever parked (no KV export)."""
        version = self.version
        return Summary(inflight=len(self.streams.reqs), kv_blocks_used=0, kv_blocks_total=0,
                       version=None if version == NO_VERSION else version, versions_held=self.versions_held,
                       request_ids=sorted(self.streams.reqs), parked=[], max_running=self.max_running,
                       block_size=self.block_size)

    # -- engine-wide pause ------------------------------------------------------------------
    @property
    def state(self) -> str:
        """`serving`, `paused` (by `pause_all()`) or `broken` (a version failed half-way)."""
        return self.serving.mode

    def pause_all(self) -> None:
        """Freeze decoding, keeping every request and its KV (SGLang `in_place`)."""
        self.serving.pause_all()

    def resume_all(self) -> None:
        """Continue decoding after `pause_all()`."""
        self.serving.resume_all()

    # -- versioned weights ------------------------------------------------------------------
    @property
    def versions_held(self) -> list[int]:
        """Versions this cell can score: the scoring copy's (`cell_copy`); none with
        `publisher_copy` (another cell scores them, from the publishing cell's kept copy)."""
        return self.scoring_versions.held if self.scoring_versions is not None else []

    def prepare_weights(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check a version's tensors against the checkpoint (names, shapes, dtypes) on the
        loader thread, so a bad version is refused before it is staged. Nothing else can be
        done ahead: SGLang updates in place. Returns the tensors for `install_prepared`."""
        check_against_manifest([TensorMeta.of(n, t) for n, t in tensors.items()], self.manifest, require_all=False)
        return dict(tensors)

    def install_prepared(self, version: int, tensors: dict[str, torch.Tensor], *, activate: bool = True) -> None:
        """Between steps: serve `version` (in-place update; the scoring copy keeps the old
        version until `drop_version`), or with `activate=False` hold it for scoring only.
        While the weights' memory is released (training role) an activated version is kept
        in host memory and installed by `enter_role("rollout")`."""
        if not activate:
            self.hold_weights(version, tensors)
        elif "weights" in self.serving.released:
            self.memory.defer(version, tensors)
        else:
            self.load_weights(version, tensors, keep_previous=True)

    def hold_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for scoring only, in the scoring copy (SGLang serves one version)."""
        if self.scoring_versions is None:
            raise EngineError(f"scoring: publisher_copy keeps no weights on this cell: version {version} "
                              "is scored on another cell, from the publishing cell's kept copy")
        self.scoring_versions.hold(version, tensors)

    def drop_version(self, version: int) -> None:
        """Free an old version from the scoring copy (the served one cannot be dropped)."""
        if version == self.version:
            raise EngineError(f"cannot drop the served version {version}")
        if self.scoring_versions is not None:
            self.scoring_versions.drop(version)

    # -- scoring ----------------------------------------------------------------------------
    def score(self, token_ids: list[int], *, temperature: float = 1.0) -> torch.Tensor:
        if self._scorer is None:
            raise EngineError("this cell does not score (scoring: publisher_copy): a cell that can score "
                              f"fetches version {self.serving.version} from the publishing cell's kept copy")
        if not self.serving.weights_valid:
            raise EngineError("no complete weight version on this cell to score with")
        return self._scorer.score(token_ids, temperature=temperature)

    def scorer(self, version: int) -> Scorer | None:
        """The scoring copy's `fn(token_ids, temperature)` for `version`, or None where the
        cell does not hold it (always with `publisher_copy`)."""
        return self.scoring_versions.scorer(version) if self.scoring_versions is not None else None

    # -- collective updates and role hand-over ----------------------------------------------
    @property
    def num_update_ranks(self) -> int:
        return self.update.num_ranks

    def receive_version(self, version: int, group: UpdateGroup, buckets: Sequence[BucketSpec | Mapping], *,
                        keep_previous: bool = False) -> None:
        """Receive `version` through an update group, in place (update.py)."""
        self.update.receive_version(version, group, buckets, keep_previous=keep_previous)

    def enter_role(self, role: str) -> None:
        """Hand GPU memory over at a role flip (memory.py)."""
        self.memory.enter_role(role)

    def release_memory(self, tags: Sequence[str] = ROLE_TAGS) -> None:
        self.memory.release(tags)

    def resume_memory(self, tags: Sequence[str] = ROLE_TAGS) -> None:
        self.memory.resume(tags)

    # -- description and counters -----------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per KV page in SGLang (`page_size`, 1 by default)."""
        return int(self.server_args.get("page_size") or 1)

    @property
    def migration_endpoint(self) -> MigrationEndpoint:
        s = self.serving
        return MigrationEndpoint(kv_export=False, kv_store=self._kv_store, model=self.config.model_path,
                                 version=s.version if s.weights_valid else None)

    @property
    def model_signature(self) -> dict:
        return {"engine": "sglang", "model": self.config.model_path, "tp": self.config.tp,
                "deterministic": self.capabilities.batch_invariant}

    def metadata(self) -> dict:
        """JSON-able description of this cell's engine (for operators and diagnostics)."""
        caps = self.capabilities
        return {"engine": "sglang", "sglang_version": self.runtime.modules.version,
                "capabilities": {"kv_export": caps.kv_export, "scoring": caps.scoring,
                                 "weight_update": caps.weight_update, "batch_invariant": caps.batch_invariant},
                "scoring": self.config.scoring, "migration": self.migration_endpoint.to_dict(),
                "migration_paths": ["kv_store", "reprefill"] if self._kv_store else ["reprefill"],
                "num_update_ranks": self.num_update_ranks, "state": self.state,
                "released": sorted(self.serving.released)}

    @property
    def tensor_bucket_bytes(self) -> int:
        """Bytes per `update_weights_from_tensor` call (tensor_update.py)."""
        return self.update.tensor_bucket_bytes

    @tensor_bucket_bytes.setter
    def tensor_bucket_bytes(self, n: int) -> None:
        self.update.tensor_bucket_bytes = n

    @property
    def engine_restarts(self) -> int:
        """SGLang restarts after a version update failed inside its group (update.py)."""
        return self.update.engine_restarts

    @property
    def kv_store_moves(self) -> Counter[str]:
        """`kv_store` moves by what SGLang found cached on resubmission: `hit` or `miss`."""
        return self.streams.kv_store_moves

    @property
    def kv_store_cached_tokens(self) -> int:
        return self.streams.kv_store_cached_tokens

    @property
    def version_tag_mismatches(self) -> int:
        """Tokens whose version SGLang's own spans contradict (must stay 0)."""
        return self.streams.version_tag_mismatches

    @property
    def ended_without_token(self) -> list[tuple[str, str]]:
        return self.streams.ended_without_token

    def close(self) -> None:
        """Stop collecting, then shut SGLang down (its child processes exit and free the GPU)."""
        self.runtime.close()

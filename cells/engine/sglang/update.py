"""Weight versions into SGLang, in place.

Version update, one line:
  pause(retract) → barrier (joined → go) → join group → begin → receive buckets → end → label
  → restart in-flight → continue → leave group
- The barrier (barrier.py) comes first: no member forms the group until the sender has seen
  every member join, so a member that never comes costs one bounded wait, and an `abort` (or
  no verdict) leaves the weights untouched. Once this engine's ranks are in the group after
  `go`, a failure is fatal for the engine: a collective may be left half-done in SGLang's
  scheduler (NCCL cannot be trusted after that), so SGLang is restarted, and the cell is
  `broken` until a complete version arrives.
- `retract` (not `in_place`): SGLang finishes the batch in flight, moves running requests
  back to its queue and frees their KV, so the cache flush that follows the update succeeds
  and no token computed under the old weights is emitted after the continue.
- The last bucket asks SGLang to flush its radix cache; each restarted request is resubmitted
  with the new version's cache salt (a HiCache store survives the flush).
- Weights change in place: once one bucket has landed the old version is gone. A failure
  after that leaves the cell `broken` (paused, serving nothing) until a complete version
  arrives; a failure before it leaves the weights and the cell's state as they were. No
  partial version is ever served.
- From tensors in this process (catch-up, deferred install): the same session, in buckets
  of ≤ 512 MB staged on the cell's GPU (tensor_update.py), the cache flushed once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from cells.engine.records import EngineError
from cells.engine.sglang.barrier import member_join
from cells.engine.sglang.scoring import ScoringReceiver, ScoringVersions
from cells.engine.sglang.serving import Serving
from cells.engine.sglang.streams import RequestStreams
from cells.engine.sglang.tensor_update import TENSOR_BUCKET_BYTES, send_in_buckets, update_device
from cells.engine.sglang.weights import BucketSpec, TensorMeta, UpdateGroup, check_against_manifest

log = logging.getLogger(__name__)


class WeightUpdate:
    """Installs versions into SGLang (and into the scoring copy, where there is one)."""

    def __init__(self, serving: Serving, streams: RequestStreams, scoring: ScoringVersions | None, *, tp: int,
                 manifest: dict[str, TensorMeta] | None, transfer_timeout_s: float) -> None:
        self.serving, self.streams, self.scoring = serving, streams, scoring
        self.runtime = serving.runtime
        self.tp, self.manifest, self.transfer_timeout_s = tp, manifest, transfer_timeout_s
        self.tensor_bucket_bytes = TENSOR_BUCKET_BYTES
        """Bytes per `update_weights_from_tensor` call (tensor_update.py)."""
        self.update_device = update_device(self.runtime.server_args)
        self.engine_restarts = 0
        """SGLang restarts after a version update failed inside its group."""

    @property
    def num_ranks(self) -> int:
        """Ranks this cell adds to a version's update group: SGLang's tp ranks, plus the
        scoring copy in `cell_copy` mode."""
        return self.tp + (1 if self.scoring is not None else 0)

    def receive_version(self, version: int, group: UpdateGroup, buckets: Sequence[BucketSpec | Mapping], *,
                        keep_previous: bool = False) -> None:
        """Receive `version` from the sender of `group`, bucket by bucket (module docstring).
        `keep_previous`: the scoring copy keeps the version it served for scoring, until
        `drop_version` (SGLang itself holds only the served version)."""
        buckets = [b if isinstance(b, BucketSpec) else BucketSpec.from_dict(b) for b in buckets]
        self.check(version, [m for b in buckets for m in b.metas()])
        self._check_group(group)
        prev = self.serving.mode
        self.runtime.pause("retract")
        if group.barrier_s is not None:
            try:
                member_join(group)
            except EngineError as e:
                self._fail(version, False, False, prev, e)
        receiver = None
        if self.scoring is not None:  # joins beside SGLang's ranks: gloo's rendezvous needs all at once
            receiver = ScoringReceiver(group, group.rank_offset + self.tp, buckets,
                                       getattr(self.scoring.copy, "device", "cpu"), self.transfer_timeout_s)
        step = {"begun": False, "touched": False, "joined": False}
        try:
            try:
                self._receive_buckets(group, buckets, step)
                if receiver is not None:
                    self.scoring.load(version, receiver.result(self.transfer_timeout_s), keep_previous=keep_previous)
            finally:
                self.runtime.leave_group(group.group_name)
        except Exception as e:
            if step["joined"] and group.barrier_s is not None:
                self.restart(version, e)
            self._fail(version, step["begun"], step["touched"], prev, e)
        self._activate(version, prev)

    def _check_group(self, group: UpdateGroup) -> None:
        if group.rank_offset < 1 or group.rank_offset + self.num_ranks > group.world_size:
            raise EngineError(f"ranks {group.rank_offset}..{group.rank_offset + self.num_ranks - 1} "
                              f"do not fit a group of {group.world_size}")
        if self.scoring is not None and group.backend == "nccl":
            raise EngineError("the scoring copy (cell_copy) cannot join an NCCL update group: its rank would "
                              "share the cell's first GPU with SGLang's tp rank 0; use gloo or publisher_copy")

    def _receive_buckets(self, group: UpdateGroup, buckets: list[BucketSpec], step: dict) -> None:
        """join group → begin → one `flattened_bucket` broadcast per bucket → end; `step`
        records how far it got (for the failure paths)."""
        self.runtime.control("init_weights_update_group", master_address=group.master_address,
                             master_port=group.master_port, rank_offset=group.rank_offset,
                             world_size=group.world_size, group_name=group.group_name, backend=group.backend)
        step["joined"] = True
        self.runtime.control("begin_weight_update")
        step["begun"] = True
        for i, b in enumerate(buckets):
            step["touched"] = True
            self.runtime.control("update_weights_from_distributed", names=list(b.names),
                                 dtypes=list(b.dtypes), shapes=[list(s) for s in b.shapes],
                                 group_name=group.group_name, flush_cache=i == len(buckets) - 1,
                                 load_format="flattened_bucket")
        self.runtime.control("end_weight_update")
        step["begun"] = False

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool = False) -> None:
        """Update in place from tensors in this process: paused (`retract`) for the update,
        continued after, every in-flight request restarted under the new version. One
        begin/end session of `flattened_bucket` payloads of ≤ `tensor_bucket_bytes`, staged
        on the cell's GPU, the cache flushed after the last (module docstring). Names/shapes
        are checked against the checkpoint first. `keep_previous`: the scoring copy keeps the
        version it served for scoring until `drop_version`; SGLang's own weights are replaced
        either way."""
        self.check(version, [TensorMeta.of(n, t) for n, t in tensors.items()])
        prev = self.serving.mode
        self.runtime.pause("retract")
        step = {"begun": False, "touched": False}

        def send(payloads: list, last: bool) -> None:
            step["touched"] = True
            self.runtime.control("update_weights_from_tensor", named_tensors=payloads,
                                 load_format="flattened_bucket", flush_cache=last)

        try:
            self.runtime.control("begin_weight_update")
            step["begun"] = True
            send_in_buckets(tensors, send, modules=self.runtime.modules, tp=self.tp, device=self.update_device,
                            bucket_bytes=self.tensor_bucket_bytes)
            self.runtime.control("end_weight_update")
            step["begun"] = False
            if self.scoring is not None:
                self.scoring.load(version, tensors, keep_previous=keep_previous)
        except Exception as e:
            self._fail(version, step["begun"], step["touched"], prev, e)
        self._activate(version, prev)

    def check(self, version: int, metas: list[TensorMeta]) -> None:
        s = self.serving
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise EngineError(f"version must be an int >= 0, got {version!r}")
        if not metas:
            raise EngineError("a version update needs at least one tensor")
        if "weights" in s.released:
            raise EngineError("weights memory is released; resume_memory(['weights']) first")
        if version == s.version and s.weights_valid:
            raise EngineError(f"already serving version {version}")
        check_against_manifest(metas, self.manifest, require_all=not s.weights_valid)

    def restart(self, version: int, err: Exception):
        """A version failed after this engine's ranks formed the update group: restart SGLang
        (module docstring) and raise. In-flight requests stay; they are resubmitted to the
        new engine once a complete version is active. Memory released to training stays
        released."""
        log.error("version %d failed inside the update group (%s): restarting SGLang", version, err)
        s = self.serving
        released = sorted(s.released)
        try:
            self.runtime.close()
        except Exception as e:  # a wedged engine may not shut down cleanly; its processes go with it
            log.warning("shutting SGLang down for a restart: %s", e)
        self.runtime.start()
        self.engine_restarts += 1
        if released:
            self.runtime.control("release_memory_occupation", tags=released)
        s.mode, s.weights_valid = "broken", False
        raise EngineError(f"version {version} failed after the update group formed ({err}); SGLang was "
                          "restarted and the cell serves nothing until a complete version loads") from err

    def _activate(self, version: int, prev: str) -> None:
        """The version is complete: serve it (or stay paused if paused before), every request
        in flight restarted under it (a token's version is its submission's version)."""
        s = self.serving
        s.version, s.weights_valid = version, True
        s.mode = "paused" if prev == "paused" else "serving"
        self.runtime.label_version(version)
        self.streams.restart_all(version)
        if s.mode == "serving":
            self.runtime.continue_generation()

    def _fail(self, version: int, begun: bool, touched: bool, prev: str, err: Exception):
        s = self.serving
        if begun:  # close SGLang's update session, or the next begin is refused
            try:
                self.runtime.control("end_weight_update")
            except Exception as e:
                log.warning("end_weight_update after a failed update: %s", e)
        if touched:
            s.mode, s.weights_valid = "broken", False
            raise EngineError(f"version {version} failed after the weights began to change ({err}); "
                              "the cell serves nothing until a complete version loads") from err
        s.mode = prev  # weights untouched: back to where it was (a broken cell stays broken)
        if prev == "serving":
            self.runtime.continue_generation()
        raise EngineError(f"version {version} not received ({err}); weights unchanged, "
                          f"version {s.version}{'' if s.weights_valid else ' (incomplete)'}") from err

"""Weight versions, pause/continue and GPU-memory handover for `SGLangEngine`.

Version update, one line:
  pause(retract) → barrier (joined → go) → join group → begin → receive buckets → end → label
  → restart in-flight → continue → leave group
- The barrier (barrier.py) comes first: no member forms the group until the sender
  has seen every member join, so a member that never comes costs one bounded wait, and an
  `abort` (or no verdict) leaves the weights untouched. Once this engine's ranks are in the
  group after `go`, a failure is fatal for the engine: a collective may be left half-done
  in SGLang's scheduler (NCCL cannot be trusted after that), so SGLang is restarted, and
  the cell is `broken` until a complete version arrives.
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

Memory handover, one line each:
  to training: (no request left) → release(weights, kv_cache)
  to rollout:  resume(weights) → version update → resume(kv_cache)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from cells.engine.records import EngineError
from cells.engine.sglang import backend as sb
from cells.engine.sglang.barrier import member_join
from cells.engine.sglang.scoring import ScoringReceiver
from cells.engine.sglang.tensor_update import send_in_buckets
from cells.engine.sglang.weights import BucketSpec, TensorMeta, UpdateGroup, check_against_manifest

log = logging.getLogger(__name__)


class ControlMixin:
    """The control half of `SGLangEngine` (the request half is in engine.py)."""

    @property
    def num_update_ranks(self) -> int:
        """Ranks this cell adds to a version's update group: SGLang's tp ranks, plus the
        scoring copy in `cell_copy` mode."""
        return self.config.tp + (1 if self._scorer is not None else 0)

    @property
    def state(self) -> str:
        """`serving`, `paused` (by `pause()`) or `broken` (a version failed half-way)."""
        return self._state

    def pause(self, request_id: str | None = None) -> None:
        """Freeze decoding, keeping every request and its KV (SGLang `in_place`).

        With a `request_id` (the embedded engine's per-request stop-and-copy): refused, since
        SGLang cannot stop one request and hand its KV over; such requests move by re-prefill
        or through a shared KV store (`migration_endpoint`)."""
        if request_id is not None:
            raise EngineError(f"cannot pause request {request_id!r} alone: SGLang has no per-request KV "
                              "export; it moves by re-prefill or through a shared KV store")
        if self._state == "broken":
            raise EngineError("cell is broken; nothing decodes")
        if self._state == "serving":
            self._tm_call(self._tm.pause_generation(self._modules.io_struct.PauseGenerationReqInput(mode="in_place")))
            self._state = "paused"

    def resume(self, request_id: str | None = None) -> None:
        """Continue decoding after `pause()`. With a `request_id` (the embedded engine's
        per-request resume after a migration's commit): start the imported request
        (`resume_request`)."""
        if request_id is not None:
            self.resume_request(request_id)
            return
        if self._state == "paused":
            self._continue()
            self._state = "serving"

    def receive_version(self, version: int, group: UpdateGroup,
                        buckets: Sequence[BucketSpec | Mapping], *, keep_previous: bool = False) -> None:
        """Receive `version` from the sender of `group`, bucket by bucket (module docstring).
        `keep_previous`: the scoring copy keeps the version it served for scoring, until
        `drop_version` (SGLang itself holds only the served version)."""
        buckets = [b if isinstance(b, BucketSpec) else BucketSpec.from_dict(b) for b in buckets]
        self._check_update(version, [m for b in buckets for m in b.metas()])
        if group.rank_offset < 1 or group.rank_offset + self.num_update_ranks > group.world_size:
            raise EngineError(f"ranks {group.rank_offset}..{group.rank_offset + self.num_update_ranks - 1} "
                              f"do not fit a group of {group.world_size}")
        if self._scorer is not None and group.backend == "nccl":
            raise EngineError("the scoring copy (cell_copy) cannot join an NCCL update group: its rank would "
                              "share the cell's first GPU with SGLang's tp rank 0; use gloo or trainer_copy")
        prev = self._state
        self._pause_for_update()
        if group.barrier_s is not None:
            try:
                member_join(group)
            except EngineError as e:
                self._fail_update(version, False, False, prev, e)
        receiver = None
        if self._scorer is not None:  # joins beside SGLang's ranks: gloo's rendezvous needs all at once
            receiver = ScoringReceiver(group, group.rank_offset + self.config.tp, buckets,
                                       getattr(self._scorer, "device", "cpu"), self.transfer_timeout_s)
        step = {"begun": False, "touched": False, "joined": False}
        try:
            try:
                self._receive_buckets(version, group, buckets, step)
                if receiver is not None:
                    self._scoring.load(version, receiver.result(self.transfer_timeout_s), keep_previous=keep_previous)
            finally:
                self._leave_group(group.group_name)
        except Exception as e:
            if step["joined"] and group.barrier_s is not None:
                self._restart_engine(version, e)
            self._fail_update(version, step["begun"], step["touched"], prev, e)
        self._activate(version, prev)

    def _receive_buckets(self, version: int, group: UpdateGroup, buckets: list[BucketSpec], step: dict) -> None:
        """join group → begin → one `flattened_bucket` broadcast per bucket → end; `step`
        records how far it got (for the failure paths)."""
        self._control("init_weights_update_group", master_address=group.master_address,
                      master_port=group.master_port, rank_offset=group.rank_offset,
                      world_size=group.world_size, group_name=group.group_name, backend=group.backend)
        step["joined"] = True
        self._control("begin_weight_update")
        step["begun"] = True
        for i, b in enumerate(buckets):
            step["touched"] = True
            self._control("update_weights_from_distributed", names=list(b.names),
                          dtypes=list(b.dtypes), shapes=[list(s) for s in b.shapes],
                          group_name=group.group_name, flush_cache=i == len(buckets) - 1,
                          load_format="flattened_bucket")
        self._control("end_weight_update")
        step["begun"] = False

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor], *, keep_previous: bool = False) -> None:
        """Update in place from tensors in this process: paused (`retract`) for the update,
        continued after, every in-flight request restarted under the new version. One
        begin/end session of `flattened_bucket` payloads of ≤ `tensor_bucket_bytes`, staged
        on the cell's GPU, the cache flushed after the last (module docstring). Names/shapes
        are checked against the checkpoint first. `keep_previous`: the scoring copy keeps the
        version it served for scoring until `drop_version`; SGLang's own weights are replaced
        either way."""
        self._check_update(version, [TensorMeta.of(n, t) for n, t in tensors.items()])
        prev = self._state
        self._pause_for_update()
        step = {"begun": False, "touched": False}

        def send(payloads: list, last: bool) -> None:
            step["touched"] = True
            self._control("update_weights_from_tensor", named_tensors=payloads, load_format="flattened_bucket",
                          flush_cache=last)

        try:
            self._control("begin_weight_update")
            step["begun"] = True
            send_in_buckets(tensors, send, modules=self._modules, tp=self.config.tp, device=self._update_device,
                            bucket_bytes=self.tensor_bucket_bytes)
            self._control("end_weight_update")
            step["begun"] = False
            if self._scoring is not None:
                self._scoring.load(version, tensors, keep_previous=keep_previous)
        except Exception as e:
            self._fail_update(version, step["begun"], step["touched"], prev, e)
        self._activate(version, prev)

    def release_memory(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """Hand GPU memory to the training role. Only with no request left and every aborted
        SGLang stream ended (drain first, release after): SGLang asserts idleness inside its
        scheduler, a crash rather than an error. Released weights (without
        `enable_weights_cpu_backup`) come back empty, so the next version received must be
        complete."""
        tags = self._check_tags(tags)
        if self.has_work() or self._imports:
            raise EngineError("requests remain on this cell; migrate them out before releasing memory")
        if self._streams:  # aborted requests stay in SGLang until it ends their streams
            self._tm_call(asyncio.wait(set(self._streams), timeout=self.transfer_timeout_s))
            if self._streams:
                raise EngineError(f"SGLang still holds {len(self._streams)} aborted requests")
        self._control("release_memory_occupation", tags=tags)
        self._released |= set(tags)
        if "weights" in tags and not self.server_args.get("enable_weights_cpu_backup"):
            self._weights_valid = False

    def resume_memory(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        tags = self._check_tags(tags)
        if not set(tags) <= self._released:
            raise EngineError(f"cannot resume {sorted(set(tags) - self._released)}: not released")
        self._control("resume_memory_occupation", tags=tags)
        self._released -= set(tags)

    def close(self) -> None:
        """Stop collecting, then shut SGLang down (its child processes exit and free the GPU)."""
        for task in list(self._streams):
            task.cancel()
        if self._streams:
            self._tm_call(asyncio.wait(set(self._streams), timeout=5.0))
        self._engine.shutdown()

    def _restart_engine(self, version: int, err: Exception):
        """A version failed after this engine's ranks formed the update group: restart SGLang
        (module docstring) and raise. In-flight requests stay; they are resubmitted to the
        new engine once a complete version is active. Memory released to training stays
        released."""
        log.error("version %d failed inside the update group (%s): restarting SGLang", version, err)
        released = sorted(self._released)
        try:
            self.close()
        except Exception as e:  # a wedged engine may not shut down cleanly; its processes go with it
            log.warning("shutting SGLang down for a restart: %s", e)
        self._start_engine()
        self.engine_restarts += 1
        if released:
            self._control("release_memory_occupation", tags=released)
        self._state = "broken"
        self._weights_valid = False
        raise EngineError(f"version {version} failed after the update group formed ({err}); SGLang was "
                          "restarted and the cell serves nothing until a complete version loads") from err

    # -- internals ---------------------------------------------------------------------

    def _check_update(self, version: int, metas: list[TensorMeta]) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise EngineError(f"version must be an int >= 0, got {version!r}")
        if not metas:
            raise EngineError("a version update needs at least one tensor")
        if "weights" in self._released:
            raise EngineError("weights memory is released; resume_memory(['weights']) first")
        if version == self._version and self._weights_valid:
            raise EngineError(f"already serving version {version}")
        check_against_manifest(metas, self.manifest, require_all=not self._weights_valid)

    def _check_tags(self, tags: Iterable[str]) -> list[str]:
        tags = list(dict.fromkeys(tags))
        bad = [t for t in tags if t not in sb.GPU_MEMORY_TAGS]
        if not tags or bad:
            raise EngineError(f"memory tags must be among {sb.GPU_MEMORY_TAGS}, got {tags}")
        return tags

    def _pause_for_update(self) -> None:
        self._tm_call(self._tm.pause_generation(self._modules.io_struct.PauseGenerationReqInput(mode="retract")))

    def _continue(self) -> None:
        self._tm_call(self._tm.continue_generation(self._modules.io_struct.ContinueGenerationReqInput()))

    def _label_version(self, version: int) -> None:
        """Name the version in SGLang too, so its per-token spans can be checked against ours."""
        obj = self._modules.io_struct.UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        self._tm_call(self._tm.update_weight_version(obj))

    def _activate(self, version: int, prev: str) -> None:
        """The version is complete: serve it (or stay paused if paused before)."""
        self._version = version
        self._weights_valid = True
        self._state = "paused" if prev == "paused" else "serving"
        self._label_version(version)
        for req in list(self._reqs.values()):
            if req.submitted and not req.done:  # restart under the new version (module docstring)
                old, req.sgl_rid = req.sgl_rid, ""  # the old submission's chunks (its abort echo) are ignored
                self._abort_in_sglang(old)
                self._submit(req)
        if self._state == "serving":
            self._continue()

    def _fail_update(self, version: int, begun: bool, touched: bool, prev: str, err: Exception):
        if begun:  # close SGLang's update session, or the next begin is refused
            try:
                self._control("end_weight_update")
            except Exception as e:
                log.warning("end_weight_update after a failed update: %s", e)
        if touched:
            self._state = "broken"
            self._weights_valid = False
            raise EngineError(f"version {version} failed after the weights began to change ({err}); "
                              "the cell serves nothing until a complete version loads") from err
        self._state = prev  # weights untouched: back to where it was (a broken cell stays broken)
        if prev == "serving":
            self._continue()
        raise EngineError(f"version {version} not received ({err}); weights unchanged, "
                          f"version {self._version}{'' if self._weights_valid else ' (incomplete)'}") from err

    def _control(self, name: str, **kwargs):
        ok, message = sb.call_ok(getattr(self._engine, name)(**kwargs))
        if not ok:
            raise EngineError(f"SGLang {name} failed: {message}")

    def _leave_group(self, group_name: str) -> None:
        try:
            self._engine.destroy_weights_update_group(group_name=group_name)
        except Exception as e:  # the group may not exist after a failed join
            log.warning("destroy_weights_update_group(%s): %s", group_name, e)

    def _tm_call(self, coro):
        return self._loop.run_until_complete(coro)

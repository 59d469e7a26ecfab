"""Weight versions, pause/continue and GPU-memory handover for `SGLangEngine`.

Version update, one line:
  pause(retract) → join group → begin → receive buckets → end → label → restart in-flight → continue → leave group
- `retract` (not `in_place`): SGLang finishes the batch in flight, moves running requests
  back to its queue and frees their KV, so the cache flush that follows the update succeeds
  and no token computed under the old weights is emitted after the continue.
- The last bucket asks SGLang to flush its radix cache; each restarted request is resubmitted
  with the new version's cache salt (a HiCache store survives the flush).
- Weights change in place: once one bucket has landed the old version is gone. A failure
  after that leaves the cell `broken` (paused, serving nothing) until a complete version
  arrives; a failure before it resumes the old version. No partial version is ever served.

Memory handover, one line each:
  to training: (no request left) → release(weights, kv_cache)
  to rollout:  resume(weights) → version update → resume(kv_cache)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from cells.engine import sglang_backend as sb
from cells.engine.interface import EngineError
from cells.engine.sglang_weights import (
    BucketSpec,
    TensorMeta,
    UpdateGroup,
    broadcast_bucket,
    bucket_crc32,
    check_against_manifest,
    join_update_group,
    unflatten_bucket,
)

log = logging.getLogger(__name__)


class ControlMixin:
    """The control half of `SGLangEngine` (the request half is in sglang_engine.py)."""

    @property
    def num_update_ranks(self) -> int:
        """Ranks this cell adds to a version's update group: SGLang's tp ranks, plus the
        scoring copy in `cell_copy` mode."""
        return self.config.tp + (1 if self._scorer is not None else 0)

    @property
    def state(self) -> str:
        """`serving`, `paused` (by `pause()`) or `broken` (a version failed half-way)."""
        return self._state

    def pause(self) -> None:
        """Freeze decoding, keeping every request and its KV (SGLang `in_place`)."""
        if self._state == "broken":
            raise EngineError("cell is broken; nothing decodes")
        if self._state == "serving":
            self._tm_call(self._tm.pause_generation(self._modules.io_struct.PauseGenerationReqInput(mode="in_place")))
            self._state = "paused"

    def resume(self) -> None:
        if self._state == "paused":
            self._continue()
            self._state = "serving"

    def receive_version(self, version: int, group: UpdateGroup,
                        buckets: Sequence[BucketSpec | Mapping]) -> None:
        """Receive `version` from the sender of `group`, bucket by bucket (module docstring)."""
        buckets = [b if isinstance(b, BucketSpec) else BucketSpec.from_dict(b) for b in buckets]
        self._check_update(version, [m for b in buckets for m in b.metas()])
        if group.rank_offset < 1 or group.rank_offset + self.num_update_ranks > group.world_size:
            raise EngineError(f"ranks {group.rank_offset}..{group.rank_offset + self.num_update_ranks - 1} "
                              f"do not fit a group of {group.world_size}")
        was_paused = self._state == "paused"
        self._pause_for_update()
        receiver = None
        if self._scorer is not None:
            receiver = _ScoringReceiver(group, group.rank_offset + self.config.tp, buckets,
                                        getattr(self._scorer, "device", "cpu"), self.transfer_timeout_s)
        begun = touched = False
        try:
            try:
                self._control("init_weights_update_group", master_address=group.master_address,
                              master_port=group.master_port, rank_offset=group.rank_offset,
                              world_size=group.world_size, group_name=group.group_name, backend=group.backend)
                self._control("begin_weight_update")
                begun = True
                for i, b in enumerate(buckets):
                    touched = True
                    self._control("update_weights_from_distributed", names=list(b.names),
                                  dtypes=list(b.dtypes), shapes=[list(s) for s in b.shapes],
                                  group_name=group.group_name, flush_cache=i == len(buckets) - 1,
                                  load_format="flattened_bucket")
                self._control("end_weight_update")
                begun = False
                if receiver is not None:
                    self._scorer.load_weights(version, receiver.result(self.transfer_timeout_s))
            finally:
                self._leave_group(group.group_name)
        except Exception as e:
            self._fail_update(version, begun, touched, was_paused, e)
        self._activate(version, was_paused)

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Update in place from tensors in this process (on the cell's GPU: SGLang hands them
        to its scheduler by CUDA IPC). Names/shapes are checked against the checkpoint first."""
        self._check_update(version, [TensorMeta.of(n, t) for n, t in tensors.items()])
        was_paused = self._state == "paused"
        self._pause_for_update()
        begun = touched = False
        try:
            self._control("begin_weight_update")
            begun = touched = True
            self._control("update_weights_from_tensor", named_tensors=list(tensors.items()), flush_cache=True)
            self._control("end_weight_update")
            begun = False
            if self._scorer is not None:
                self._scorer.load_weights(version, tensors)
        except Exception as e:
            self._fail_update(version, begun, touched, was_paused, e)
        self._activate(version, was_paused)

    def release_memory(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """Hand GPU memory to the training role. Only with no request left: SGLang requires
        an idle engine. Released weights (without `enable_weights_cpu_backup`) come back
        empty, so the next version received must be complete."""
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
        """Shut SGLang down (its child processes exit and free the GPU)."""
        self._engine.shutdown()

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

    def _activate(self, version: int, was_paused: bool) -> None:
        self._version = version
        self._weights_valid = True
        self._state = "paused" if was_paused else "serving"
        self._label_version(version)
        for req in list(self._reqs.values()):
            if req.submitted and not req.done:  # restart under the new version (module docstring)
                self._tm.abort_request(rid=req.sgl_rid)
                self._submit(req)
        if not was_paused:
            self._continue()

    def _fail_update(self, version: int, begun: bool, touched: bool, was_paused: bool, err: Exception):
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
        self._state = "paused" if was_paused else "serving"
        if not was_paused:
            self._continue()
        raise EngineError(f"version {version} not received ({err}); still serving {self._version}") from err

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


class _ScoringReceiver:
    """The scoring copy's rank in an update group, on its own thread: SGLang's ranks join the
    same collectives from its scheduler process while the cell agent's thread drives them."""

    def __init__(self, group: UpdateGroup, rank: int, buckets: list[BucketSpec], device, timeout_s: float):
        self._args = (group, rank, buckets, device, timeout_s)
        self._tensors: dict[str, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scoring-copy-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        group, rank, buckets, device, timeout_s = self._args
        bad: list[str] = []
        try:
            pg = join_update_group(group, rank, timeout_s)
            for b in buckets:  # receive every bucket even after a bad one: peers wait on each
                flat = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
                broadcast_bucket(pg, flat, timeout_s)
                if b.crc32 is not None and bucket_crc32(flat) != b.crc32:
                    bad.append(b.names[0])
                self._tensors.update(unflatten_bucket(flat, b))
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

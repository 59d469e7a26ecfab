"""The version host's update groups: a version served to cells whose engine receives through
its own collective (SGLang: `update_ranks` > 0). The cell side is
`cells.transport.receive.await_update_group` / `report_update`.

One line, per attempt: members say ready → the trainer binds a rendezvous, writes each
member's group spec and the bucket plan → join barrier (every member's engine joined, or the
attempt is called off) → the trainer joins as rank 0 → one flattened bucket per
`update_weights_from_distributed` → each member reports. A member whose engine failed asks
for the next attempt (a fresh group), at most `GROUP_ATTEMPTS` in all.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
from torch.distributed import Store, TCPStore

from cells.engine.records import EngineError
from cells.engine.sglang.barrier import sender_verdict
from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    UpdateGroup,
    broadcast_bucket,
    bucket_crc32,
    flatten_bucket,
    join_update_group,
    plan_buckets,
)
from cells.transport.broadcast import BroadcastResult, settle_reports
from cells.transport.p2p import TransferError, discard
from cells.transport.receive import group_key
from cells.transport.store import StoreAddress, connect, set_json, wait_keys

log = logging.getLogger("cellflip.versions")

GROUP_ATTEMPTS = 3
"""Update groups the trainer forms for one version at most (the first, then retries)."""

UPDATE_BACKENDS = ("gloo", "nccl")


def update_plan(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[BucketSpec]:
    """The buckets engines receive, in order, each with the CRC32 of its flattened bytes (the
    engine's verifying rank checks it). EngineError for a dtype the engines cannot load."""
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    return [BucketSpec(b.names, b.dtypes, b.shapes, bucket_crc32(flatten_bucket([tensors[n] for n in b.names])))
            for b in plan_buckets(metas, bucket_bytes)]


class UpdateGroupSender:
    """Sends versions over update groups from the host's store at `address`. `backend`: the
    collective ("gloo" sends from host memory; "nccl" stages each bucket on this process's
    GPU first)."""

    def __init__(self, address: StoreAddress, *, namespace: str, bucket_bytes: int, timeout_s: float,
                 join_timeout_s: float, backend: str) -> None:
        if backend not in UPDATE_BACKENDS:
            raise ValueError(f"update_backend must be one of {UPDATE_BACKENDS}, got {backend!r}")
        self._address, self.namespace, self.bucket_bytes = address, namespace, bucket_bytes
        self.timeout_s, self.join_timeout_s, self.backend = timeout_s, join_timeout_s, backend

    def check_unused(self, version: int) -> None:
        """ValueError if `version` was already sent over update groups (its keys are single-use)."""
        store = connect(self._address, timeout_s=self.timeout_s)
        if store.check([group_key(self.namespace, version, "plan", 0)]):
            raise ValueError(f"version {version} was already sent over update groups: "
                             "catch cells up with fetch_version")

    def send(self, version: int, tensors: dict[str, torch.Tensor], cells: list[str],
             ranks: dict[str, int]) -> BroadcastResult:
        """Sends `version` to `cells` over update groups: a fresh group per attempt, with the
        members that said they are ready; after a failed attempt the members that asked for a
        retry get another group, up to `GROUP_ATTEMPTS`. Every wait is bounded: a cell that is
        late, dead, or whose engine never joins ends in `failed`, never hangs the trainer."""
        t0 = time.monotonic()
        result = BroadcastResult(version)
        store = connect(self._address, timeout_s=self.timeout_s)
        key = lambda *p: group_key(self.namespace, version, *p)  # noqa: E731
        try:
            buckets = update_plan(tensors, self.bucket_bytes)
        except EngineError as e:  # a dtype the engines cannot load: release the waiters at once
            set_json(store, key("plan", 0), {"members": [], "retry_within_s": 0})
            result.failed = {c: f"no update plan: {e}" for c in cells}
            return result
        # A member learns of a failure within one op timeout; it then reports in.
        settle_s = self.timeout_s + 5.0
        retry_s = self.join_timeout_s + self.timeout_s + settle_s + 2.0
        pending, attempt, join_wait = list(cells), 0, self.join_timeout_s
        while pending and attempt < GROUP_ATTEMPTS:
            present = set(wait_keys(store, [key("ready", attempt, c) for c in pending], join_wait))
            members = [c for c in pending if key("ready", attempt, c) in present]
            for c in pending:
                if c not in members:
                    result.failed[c] = "did not join" if attempt == 0 else "silent after a failed attempt"
            result.num_attempts = attempt + 1
            if not members:
                pending = []
                break
            backend, keep, error = self._run_attempt(store, key, version, attempt, members, ranks,
                                                          buckets, tensors, retry_s)
            if error and backend is not None:  # fail the members still waiting on us now
                discard(backend, keep, broken=True)
                backend = None
            pending = settle_reports(store, key, result, members, attempt, error, settle_s)
            if backend is not None:  # members have the tail: close cleanly
                discard(backend, keep, broken=False)
                backend = None
            attempt, join_wait = attempt + 1, 0.0  # retries wrote ready/{attempt+1} already
        for c in pending:
            result.failed[c] = f"gave up after {GROUP_ATTEMPTS} attempts"
        set_json(store, key("plan", attempt), {"members": [], "retry_within_s": 0})  # release waiters
        result.seconds = time.monotonic() - t0
        return result

    def _run_attempt(self, store: Store, key, version: int, attempt: int, members: list[str],
                          ranks: dict[str, int], buckets: list[BucketSpec],
                          tensors: dict[str, torch.Tensor], retry_s: float) -> tuple[object, list, str]:
        """One attempt: rendezvous, specs and plan, join as rank 0, every bucket. Returns the
        backend (None if the join failed), buffers an unfinished op may still touch, and the
        error ("" if every bucket left)."""
        world = 1 + sum(ranks[c] for c in members)
        # The trainer binds the rendezvous first, on a free port, so the port it publishes is
        # one it holds; joins wait on the backend's own deadline, not on this store.
        try:
            master = TCPStore(self._address.host, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.join_timeout_s))
        except Exception as e:  # nothing to join: release the members at once
            set_json(store, key("plan", attempt), {"members": [], "retry_within_s": 0})
            return None, [], f"update-group rendezvous could not listen on {self._address.host}: {e}"[:500]
        name = f"{self.namespace}-v{version}-a{attempt}"
        plan = [b.to_dict() for b in buckets]
        offset, offsets = 1, {}
        for c in members:
            group = UpdateGroup(self._address.host, master.port, offset, world, name, self.backend,
                                barrier_s=self.join_timeout_s)
            set_json(store, key("spec", attempt, c), {"group": group.to_dict(), "buckets": plan})
            offsets[c] = offset
            offset += ranks[c]
        set_json(store, key("plan", attempt), {"members": members, "retry_within_s": retry_s})
        # Every member's engine says it joined before anyone forms the group: NCCL sets its
        # communicator up inside the first collective, with no timeout of ours, so a member that
        # never comes would hold this thread and every other member's engine (cells/engine/sglang/barrier.py).
        missing = sender_verdict(master, name, offsets, self.join_timeout_s)
        if missing:
            why = f"{missing} did not reach the update group's barrier in {self.join_timeout_s:.1f}s; called off"
            log.warning("version %d update group %s: %s", version, name, why)
            return None, [master], why[:500]  # the members read the verdict from it: keep it up a while
        device = torch.device("cuda" if self.backend == "nccl" else "cpu")
        backend, keep = None, []
        try:
            group = UpdateGroup(self._address.host, master.port, 0, world, name, self.backend)
            backend = join_update_group(group, 0, self.join_timeout_s, store=master)
            for i, b in enumerate(buckets):
                flat = flatten_bucket([tensors[n] for n in b.names]).to(device)
                keep[:] = [flat]  # an op that timed out may still read it
                try:
                    broadcast_bucket(backend, flat, self.timeout_s)
                except Exception as e:
                    raise TransferError(f"bucket {i}/{len(buckets)}: {e}") from e
            keep.clear()
            return backend, keep, ""
        except Exception as e:  # rendezvous, backend setup or a bucket: this attempt failed
            why = str(e) if isinstance(e, TransferError) else f"group join failed: {e}"
            log.warning("version %d update group %s (%d ranks): %s", version, name, world, why)
            return backend, keep, why[:500]

"""Versioned weight broadcast: the trainer (rank 0) → rollout cells, in CRC-checked buckets.

One line: join → plan → manifest → buckets (next in flight while the previous is staged) →
verify → report; after a failed collective, the live remainder retries over a fresh group.

Control exchange: keys in the sender's store under `{namespace}/{version}/`.
  ready/{a}/{cell}   receiver: alive and waiting for attempt a (after a failed attempt it
                     writes ready/{a+1} at once: "retry me")
  head               sender, once before plan/0 (split format): the manifest, every bucket's
                     CRC32 and buckets per op, read by members while the group forms
  plan/{a}           sender: {"members": [cell, ...], "retry_within_s": s, "head": bool};
                     members in rank order (rank = index + 1); an empty list ends the
                     broadcast for whoever still waits; after a failure the next plan comes
                     within retry_within_s; without "head" the manifest is the group's first op
  result/{a}/{cell}  receiver: {"ok": bool, "reason": str} once it checked the last bucket
  pg/{a}/            rendezvous of attempt a's group
The sender learns who is alive from these keys, each wait under its own deadline, and never
from the collective: a dead member may be a tree leaf whose death the root never sees.
A cell outside a plan (late, silent, or checksum-failed) keeps its old version and catches
up point-to-point: `send_version_p2p` / `recv_version_p2p` over a `PairChannel`.
Activation is the engine's job: a receiver only exposes tensors whose every bucket matched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import Store

from cells.transport.buckets import (
    DEFAULT_BUCKET_BYTES,
    FOOTER,
    BucketPacker,
    BucketUnpacker,
    FlatVersion,
    Manifest,
)
from cells.transport.catchup import recv_version_p2p, send_version_p2p  # noqa: F401 (re-export)
from cells.transport.p2p import TransferError, count_bytes, discard, join_group, wait_work
from cells.transport.staging import FlatReceipt, StagingBuffers, empty_flat
from cells.transport.store import get_json, poll_sleeps, set_json, wait_json, wait_keys
from scheduler.contract.failpoints import failpoint

SETTLE_POLL_S = 0.002  # longest poll period for the reports (the sender's own store)
SETTLE_EXTRA_S = 5.0  # by default the sender waits this long past one op timeout for reports
SPLIT_OP_BYTES = 128 << 20
"""Bytes per op of the split format (several CRC buckets an op: each op costs every rank a wake-up;
412 MB to 1 receiver on 2 busy cores: 128 MiB ops faster than 64, 32, 16 or 8 MiB)."""


@dataclass
class BroadcastResult:
    version: int
    delivered: list[str] = field(default_factory=list)
    """Cells that verified every bucket; they may activate the version."""
    failed: dict[str, str] = field(default_factory=dict)
    """Cell → why it has no verified copy; each catches up point-to-point."""
    num_attempts: int = 0
    seconds: float = 0.0


def _bcast(backend, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    count_bytes("send" if backend.rank() == 0 else "recv", tensor)
    return backend.broadcast([tensor], opts)


def _bcast_json(backend, obj: dict | None, timeout_s: float, device, keep: list) -> dict:
    """Rank 0 sends `obj`, the others receive it: a length, then the bytes, as uint8.
    Buffers go to `keep`: after a timeout the op may still write into them."""
    data = json.dumps(obj, separators=(",", ":")).encode() if obj is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    keep.append(n)
    wait_work(_bcast(backend, n), timeout_s, "manifest length")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else (
        torch.empty(int(n.item()), dtype=torch.uint8, device=device))
    keep.append(buf)
    wait_work(_bcast(backend, buf), timeout_s, "manifest")
    try:
        return json.loads(bytes(buf.cpu().numpy()))
    except ValueError as e:
        raise TransferError(f"malformed manifest JSON: {e}") from e


def _parse_manifest(d: dict) -> Manifest:
    try:
        return Manifest.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:  # a peer speaking another protocol
        raise TransferError(f"malformed manifest: {e!r}") from e


def _pipeline(num_buckets: int, post: Callable[[int], object], finish: Callable[[int], None], timeout_s,
              depth: int = 2):
    """Keeps `depth` buckets in flight: bucket i+1 travels while bucket i is finished (staged,
    or its buffer reused). The split format posts every bucket at once (its buffer is the
    whole version): the bytes keep flowing while this thread waits for the CPU."""
    works = {i: post(i) for i in range(min(depth, num_buckets))}
    for i in range(num_buckets):
        wait_work(works.pop(i), timeout_s, f"bucket {i}/{num_buckets}")
        finish(i)
        if i + depth < num_buckets:
            works[i + depth] = post(i + depth)


class WeightSender:
    """The trainer side. `send_version` blocks until the version is delivered or given up."""

    def __init__(
        self,
        store: Store,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 30.0,
        join_timeout_s: float = 30.0,
        settle_timeout_s: float | None = None,
        max_attempts: int = 3,
        namespace: str = "bc",
        device: str | torch.device = "cpu",
        bucket_hook: Callable[[int], None] | None = None,
        op_bytes: int = SPLIT_OP_BYTES,
    ) -> None:
        self.store, self.bucket_bytes, self.timeout_s = store, bucket_bytes, timeout_s
        self.join_timeout_s, self.max_attempts, self.namespace = join_timeout_s, max_attempts, namespace
        # A member learns of a failure within one op timeout; it then reports in.
        self.settle_timeout_s = timeout_s + SETTLE_EXTRA_S if settle_timeout_s is None else settle_timeout_s
        self.device, self.op_bytes = torch.device(device), op_bytes  # op_bytes: split format, per op
        self.bucket_hook = bucket_hook  # fault injection: called after bucket i left

    def send_version(self, version: int, tensors: dict[str, torch.Tensor] | FlatVersion,
                     receivers: list[str]) -> BroadcastResult:
        """Broadcasts `tensors` as `version` to `receivers` (cell ids). Does not modify tensors.
        A FlatVersion (checksums computed once, e.g. when the trainer stored the version)
        goes out in the split format: payloads straight from its buffer, no packing."""
        t0 = time.monotonic()
        if isinstance(tensors, FlatVersion):
            if tensors.manifest.version != version:
                raise ValueError(f"flat version {tensors.manifest.version} sent as {version}")
            manifest, packer = tensors.manifest, tensors
        else:
            manifest = Manifest.build(version, tensors, self.bucket_bytes)
            packer = BucketPacker(manifest, tensors)
        key = lambda *p: "/".join([self.namespace, str(version), *map(str, p)])
        if self.store.check([key("plan", 0)]):
            raise ValueError(f"version {version} was already broadcast under {self.namespace!r}: "
                             "catch cells up with send_version_p2p, or use a fresh namespace")
        result = BroadcastResult(version)
        if isinstance(packer, FlatVersion):  # members read it while the group forms: no op
            per_op = max(1, self.op_bytes // manifest.bucket_bytes)
            set_json(self.store, key("head"), {**manifest.to_dict(), "wire": "split", "crcs": packer.crcs,
                                               "per_op": per_op})
        pending, attempt, join_wait = list(dict.fromkeys(receivers)), 0, self.join_timeout_s
        # A member that failed early waits for our own failure detection, then the settle.
        retry_s = self.timeout_s + self.settle_timeout_s + 2.0
        while pending and attempt < self.max_attempts:
            present = set(wait_keys(self.store, [key("ready", attempt, c) for c in pending], join_wait))
            members = [c for c in pending if key("ready", attempt, c) in present]
            for c in pending:
                if c not in members:
                    result.failed[c] = "did not join" if attempt == 0 else "silent after a failed attempt"
            set_json(self.store, key("plan", attempt),
                     {"members": members, "retry_within_s": retry_s, "head": isinstance(packer, FlatVersion)})
            result.num_attempts = attempt + 1
            if not members:
                return self._finish(result, t0)
            error, backend, keep = "", None, []
            try:
                backend = join_group(self.store, key("pg", attempt) + "/", 0, len(members) + 1,
                                     timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s, device=self.device)
                self._run(backend, manifest, packer, keep)
            except TransferError as e:
                error = str(e)
            # After a failure, closing our side at once fails the members still waiting on
            # us now rather than after their op timeout. After a success the group stays up
            # until members report, so that no one loses the tail of the last bucket to a
            # connection this side closed early.
            if error and backend is not None:
                discard(backend, keep, broken=True)
                backend = None
            pending = settle_reports(self.store, key, result, members, attempt, error, self.settle_timeout_s)
            if backend is not None:
                discard(backend, keep, broken=False)
                backend = None
            attempt, join_wait = attempt + 1, 0.0  # pending ones wrote ready/{attempt+1} already
        for c in pending:
            result.failed[c] = f"gave up after {self.max_attempts} attempts"
        set_json(self.store, key("plan", attempt), {"members": [], "retry_within_s": 0})  # release waiters
        return self._finish(result, t0)

    def _run(self, backend, manifest: Manifest, packer: BucketPacker | FlatVersion, keep: list) -> None:
        if isinstance(packer, FlatVersion):
            return self._run_split(backend, packer, keep)
        _bcast_json(backend, manifest.to_dict(), self.timeout_s, self.device, keep)
        bufs = [torch.empty(manifest.bucket_bytes + FOOTER.size, dtype=torch.uint8, device=self.device)
                for _ in range(2)]
        keep.extend(bufs)

        def finish(i: int) -> None:
            if self.bucket_hook is not None:
                self.bucket_hook(i)
            failpoint("broadcast.mid_bucket")

        # Bucket i+2 is packed (and its CRC computed) into bucket i's buffer while i+1 travels.
        _pipeline(manifest.num_buckets, lambda i: _bcast(backend, packer.pack(i, bufs[i % 2])),
                  finish, self.timeout_s)

    def _run_split(self, backend, flat: FlatVersion, keep: list) -> None:
        per_op = max(1, self.op_bytes // flat.manifest.bucket_bytes)  # as in the head
        num_buckets = flat.manifest.num_buckets
        n = -(-num_buckets // per_op)

        def finish(j: int) -> None:  # op j has left: its buckets, one failpoint hit each
            for i in range(j * per_op, min(num_buckets, (j + 1) * per_op)):
                if self.bucket_hook is not None:
                    self.bucket_hook(i)
                failpoint("broadcast.mid_bucket")

        _pipeline(n, lambda j: _bcast(backend, flat.payloads(j * per_op, per_op)), finish, self.timeout_s, depth=n)

    def _finish(self, result: BroadcastResult, t0: float) -> BroadcastResult:
        result.seconds = time.monotonic() - t0
        return result


def settle_reports(store, key, result: BroadcastResult, members: list[str], attempt: int, error: str,
                   settle_s: float) -> list[str]:
    """After one attempt of a group transfer, sorts `members` into `result.delivered` /
    `result.failed` from the reports each writes at `key("result", attempt, cell)`, or into
    the returned retries (those that wrote `key("ready", attempt + 1, cell)` instead). A
    member silent for `settle_s` is failed, with the attempt's `error` if there was one."""
    sleeps = poll_sleeps(time.monotonic() + settle_s, SETTLE_POLL_S)
    todo, retry = list(members), []
    while todo:
        for c in list(todo):
            if store.check([key("result", attempt, c)]):
                r = get_json(store, key("result", attempt, c))
                if isinstance(r, dict) and r.get("ok") is True:
                    result.delivered.append(c)
                else:
                    result.failed[c] = str(r.get("reason") if isinstance(r, dict) else r)[:500]
                todo.remove(c)
            elif store.check([key("ready", attempt + 1, c)]):
                retry.append(c)
                todo.remove(c)
        if not todo or not next(sleeps):
            break
    for c in todo:
        result.failed[c] = f"no report after attempt {attempt}" + (f" ({error})" if error else "")
    return retry


class WeightReceiver:
    """The rollout-cell side. `receive_version` blocks until the version is verified, or
    returns False (the cell keeps its old version and catches up point-to-point later)."""

    def __init__(
        self,
        store: Store,
        cell_id: str,
        *,
        timeout_s: float = 30.0,
        join_timeout_s: float = 60.0,
        namespace: str = "bc",
        device: str | torch.device = "cpu",
        bucket_hook: Callable[[int, torch.Tensor], None] | None = None,
        buffers: StagingBuffers | None = None,
    ) -> None:
        self.store, self.cell_id, self.timeout_s = store, cell_id, timeout_s
        self.buffers = buffers  # warm buffers the version lands in (fresh ones when None)
        self.join_timeout_s, self.namespace, self.device = join_timeout_s, namespace, torch.device(device)
        self.bucket_hook = bucket_hook  # fault injection: sees each wire bucket before its check
        self.version: int | None = None
        """The version held verified in staging, or None."""
        self.last_error: str | None = None
        self._staging: dict[str, torch.Tensor] | None = None

    def receive_version(self, version: int, staging: dict[str, torch.Tensor] | None = None) -> bool:
        """Receives `version` into `staging` (mutated even on failure; when None, into a warm
        buffer of `buffers` where one is free, else a fresh one).
        Drops any previously received version first; True only once every bucket's CRC
        matched. Blocks for the whole broadcast: call it off the engine's step loop."""
        self.version, self._staging, self.last_error = None, None, None
        key = lambda *p: "/".join([self.namespace, str(version), *map(str, p)])
        attempt, plan_wait = 0, self.join_timeout_s
        try:
            while True:
                set_json(self.store, key("ready", attempt, self.cell_id), {})
                plan = wait_json(self.store, key("plan", attempt), plan_wait)
                if plan is None or self.cell_id not in plan["members"]:
                    why = f"no plan for attempt {attempt} within {plan_wait:.1f}s (sender gone)" if plan is None \
                        else f"not in the plan of attempt {attempt}"
                    self.last_error = why + (f"; after: {self.last_error}" if self.last_error else "")
                    return False
                plan_wait = float(plan["retry_within_s"])
                try:
                    unpacker = self._run(key, attempt, plan, version, staging)
                except TransferError as e:  # a collective failed: ask for the next attempt
                    self.last_error, attempt = str(e), attempt + 1
                    continue
                ok, reason = _verdict(unpacker)  # reported by _run already
                if ok:
                    self.version, self._staging, self.last_error = version, unpacker.staging, None
                else:
                    self.last_error = reason
                return ok
        except dist.DistError as e:  # the sender's store went away with the sender
            self.last_error = f"store unreachable: {e}"
            return False

    def _receive_split(self, backend, manifest: Manifest, head: dict, staging, keep: list) -> FlatReceipt:
        """Payloads land straight in one flat buffer (warm where `buffers` has one free), all
        posted at once, `per_op` buckets an op, and each bucket is checked there against its
        CRC32 from the header (no unpacking copy); a given `staging` dict gets a copy of the
        verified tensors at the end."""
        n, crcs, per_op = manifest.num_buckets, head.get("crcs"), head.get("per_op", 1)
        if not isinstance(crcs, list) or len(crcs) != n or not all(isinstance(c, int) for c in crcs) \
                or not isinstance(per_op, int) or per_op < 1:
            raise TransferError(f"malformed split header: {n} bucket checksums and per_op >= 1 expected")
        flat = empty_flat(self.buffers, manifest, self.device)
        keep.append(flat.buf)
        receipt = FlatReceipt(flat, staging)

        def finish(j: int) -> None:
            if j == 0:
                receipt.prepare()  # the later ops are in flight meanwhile
            for i in range(j * per_op, min(n, (j + 1) * per_op)):
                if self.bucket_hook is not None:
                    self.bucket_hook(i, flat.payload(i))
                receipt.num_unpacked += 1
                if not flat.check_crc(i, crcs[i]):
                    receipt.bad.append(i)  # recorded; keep the collective going
                failpoint("broadcast.mid_bucket")

        ops = -(-n // per_op)
        _pipeline(ops, lambda j: _bcast(backend, flat.payloads(j * per_op, per_op)), finish, self.timeout_s, depth=ops)
        receipt.finish()
        return receipt

    def received_tensors(self) -> dict[str, torch.Tensor]:
        """The verified tensors of `self.version`; raises TransferError if none is complete."""
        if self.version is None or self._staging is None:
            raise TransferError(f"{self.cell_id}: no verified version ({self.last_error})")
        return self._staging

    def _run(self, key, attempt: int, plan: dict, version: int, staging) -> BucketUnpacker:
        members = plan["members"]
        head = get_json(self.store, key("head")) if plan.get("head") else None  # checked by _parse_manifest
        backend = join_group(
            self.store, key("pg", attempt) + "/", members.index(self.cell_id) + 1, len(members) + 1,
            timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s, device=self.device,
        )
        keep: list[torch.Tensor] = []
        broken = True
        try:
            if head is None:
                head = _bcast_json(backend, None, self.timeout_s, self.device, keep)
            manifest = _parse_manifest(head)
            if manifest.version != version:
                raise TransferError(f"expected version {version}, sender sent {manifest.version}")
            if head.get("wire") == "split":
                unpacker = self._receive_split(backend, manifest, head, staging, keep)
                broken = False
                return self._report(key, attempt, unpacker)
            if staging is None and self.buffers is not None:
                staging = self.buffers.flat(manifest, self.device).tensors()
            unpacker = BucketUnpacker(manifest, staging, self.device)
            bufs = [torch.empty(manifest.bucket_bytes + FOOTER.size, dtype=torch.uint8, device=self.device)
                    for _ in range(2)]
            keep.extend(bufs)
            wire = lambda i: bufs[i % 2][: manifest.wire_bytes(i)]

            def finish(i: int) -> None:
                if self.bucket_hook is not None:
                    self.bucket_hook(i, wire(i))
                unpacker.unpack(i, wire(i))  # a mismatch is recorded; keep the collective going
                failpoint("broadcast.mid_bucket")

            _pipeline(manifest.num_buckets, lambda i: _bcast(backend, wire(i)), finish, self.timeout_s)
            broken = False
            return self._report(key, attempt, unpacker)
        finally:
            discard(backend, keep, broken=broken)

    def _report(self, key, attempt: int, unpacker):
        """Tells the sender the verdict before the group is dropped: tearing a group down
        holds this process up for a while, and the sender waits for every report."""
        ok, reason = _verdict(unpacker)
        set_json(self.store, key("result", attempt, self.cell_id), {"ok": ok, "reason": reason})
        return unpacker


def _verdict(unpacker) -> tuple[bool, str]:
    ok = unpacker.is_verified
    return ok, "" if ok else f"checksum mismatch in buckets {unpacker.bad[:8]}"

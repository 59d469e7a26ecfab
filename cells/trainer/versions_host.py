"""The trainer's version host: every unretired weight version in host memory, broadcast to
rollout cells and served point to point to cells that missed it.

One line: put → broadcast (trainer = rank 0 of a fresh group) → cells outside it take a
catch-up ticket → header → buckets → verdict → drop when the version is retired.

Two kinds of receivers share one publish (`broadcast(version, receivers, receiver_ranks)`):
- embedded cells (`update_ranks` 0) join the bucketed, CRC-checked broadcast of
  cells/transport/broadcast.py;
- cells whose engine receives through its own collective (SGLang: `update_ranks` > 0) are
  served afterwards over an update group (one per attempt): ready → plan (each member's group
  spec and the bucket plan) → the engine's ranks join a TCP rendezvous at the trainer → one
  flattened bucket per `update_weights_from_distributed` → each member reports.

Store keys, in the host's own TCPStore (JSON values only, nothing pickled):
  {ns}/bc/{version}/...     the broadcast's control exchange (see cells/transport/broadcast.py)
  {ns}/ug/{version}/...     the update-group exchange of engine-collective cells:
    ready/{a}/{cell}        cell: alive and waiting for attempt a (after a failed attempt it
                            writes ready/{a+1} at once: "retry me", at most `GROUP_RETRIES` times)
    spec/{a}/{cell}         trainer: {"group": UpdateGroup, "buckets": [BucketSpec]}, written
                            before plan/{a} names the cell
    plan/{a}                trainer: {"members": [...], "retry_within_s": s}; members in rank
                            order; an empty list ends the exchange for whoever still waits
    result/{a}/{cell}       cell: {"ok": bool, "reason": str} once its engine is done
  {ns}/catchup/next         ticket counter; a client takes `n = add(next, 1)`
  {ns}/catchup/req/{n}      client: {"cell": cell_id, "version": v}; the server deletes it
                            once read
  pair/{ns}/catchup/{n}/    rendezvous of ticket n's PairChannel (host rank 0, cell rank 1)
On that channel the host first sends a JSON header, {"ok": true} or {"ok": false, "error":
"version 7 is not held (held: [5, 6])"}, then (if ok) the version by `send_version_p2p`.

Guarantees:
- A held version never changes: `put` keeps its own contiguous CPU copy, and a second `put`
  of that version must be bitwise identical. A transfer holds its own reference, so a
  `drop` during a catch-up or broadcast of that version does not disturb it.
- Tickets are dispatched in ticket order as their requests appear, at most
  `max_concurrent_catchups` at once, each on its own thread with its own store connection.
  A ticket whose request does not appear within `request_timeout_s` (a client that died
  between `add` and `set`) is skipped, and it never delays later tickets meanwhile; a client
  that dies mid-transfer fails only its own worker, within one op timeout.
- The cell side returns only tensors whose every bucket matched its CRC32; any other outcome
  is an exception (`fetch_version`) or a reason (`receive_broadcast`), never a partial
  version.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
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
from cells.transport.broadcast import BroadcastResult, WeightReceiver, WeightSender, settle_reports
from cells.transport.buckets import DEFAULT_BUCKET_BYTES, FlatVersion, byte_view
from cells.transport.catchup import recv_version_p2p, send_version_p2p
from cells.transport.p2p import PairChannel, TransferError, discard
from cells.transport.store import (
    POLL_S,
    StoreAddress,
    StoreHost,
    connect,
    get_json,
    set_json,
    wait_json,
    wait_keys,
)

log = logging.getLogger("cellflip.versions")

REQUEST_TIMEOUT_S = 5.0
"""How long a taken ticket may stay without its request before the server skips it: a live
client writes it right after `add`, so only a dead one takes this long."""

CLOSE_GRACE_S = 5.0
"""How long `close` waits for catch-ups in flight before leaving them to their own timeouts."""

_ERROR_BACKOFF_S = 0.5
"""Pause of the server loop after a store error, so that a gone store is not hammered."""

GROUP_ATTEMPTS = 3
"""Update groups the trainer forms for one version at most (the first, then retries)."""

GROUP_RETRIES = 1
"""Retries a cell asks for after its engine failed an update (a fresh group each). A cell
that cannot take part at all (a refused update) must not hold its peers' retries up, so it
asks only this often; after that it catches up point-to-point."""

UPDATE_BACKENDS = ("gloo", "nccl")


class VersionUnavailable(TransferError):
    """The host does not hold the requested version (never put, or dropped already)."""


class Received(NamedTuple):
    """Outcome of `receive_broadcast`: verified tensors, or None and the reason why not."""

    tensors: dict[str, torch.Tensor] | None
    error: str | None


def _catchup_key(namespace: str, *parts: object) -> str:
    return "/".join([namespace, "catchup", *map(str, parts)])


def _group_key(namespace: str, version: int, *parts: object) -> str:
    return "/".join([namespace, "ug", str(version), *map(str, parts)])


@dataclass(frozen=True)
class UpdateAssignment:
    """A cell's part in one attempt of a version's update group: where to join (its own
    `rank_offset`) and the buckets, in order, that its engine receives."""

    version: int
    attempt: int
    group: UpdateGroup
    buckets: tuple[BucketSpec, ...]
    retry_within_s: float
    """How long to wait for the next attempt's plan after this one failed."""


def _check_tensors(tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _same_content(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two versions: names in order, dtypes, shapes and bytes (NaN == NaN)."""
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(byte_view(a[k]), byte_view(b[k]))
        for k in a
    )


def _receiver_ranks(receivers: list[str], receiver_ranks: dict[str, int] | None) -> dict[str, int]:
    """Cell → update ranks (0: the cell receives the bucketed broadcast itself)."""
    out: dict[str, int] = {}
    for c in receivers:
        n = (receiver_ranks or {}).get(c, 0) or 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"receiver_ranks[{c!r}] must be an int >= 0, got {n!r}")
        out[c] = n
    return out


def _merge(into: BroadcastResult, other: BroadcastResult) -> None:
    into.delivered.extend(other.delivered)
    into.failed.update(other.failed)
    into.num_attempts = max(into.num_attempts, other.num_attempts)


def _update_plan(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[BucketSpec]:
    """The buckets engines receive, in order, each with the CRC32 of its flattened bytes (the
    engine's verifying rank checks it). EngineError for a dtype the engines cannot load."""
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    return [BucketSpec(b.names, b.dtypes, b.shapes, bucket_crc32(flatten_bucket([tensors[n] for n in b.names])))
            for b in plan_buckets(metas, bucket_bytes)]


class VersionHost:
    """Holds the trainer's unretired weight versions and serves them to rollout cells.

    Lives in the trainer process. `address` is what the trainer tells the scheduler; cells
    reach the host with `receive_broadcast` (when named in a broadcast), `await_update_group`
    (the same, for cells whose engine receives through its own collective) or
    `fetch_version` (any time, once `start()` has run). `put`/`get`/`drop` may be called from any thread
    while broadcasts and catch-ups run.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 30.0,
        join_timeout_s: float = 30.0,
        namespace: str = "versions",
        max_concurrent_catchups: int = 4,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        update_backend: str = "gloo",
    ) -> None:
        """`update_backend`: the collective of update groups (engine-collective cells): "gloo"
        sends from host memory; "nccl" stages each bucket on this process's GPU first."""
        if update_backend not in UPDATE_BACKENDS:
            raise ValueError(f"update_backend must be one of {UPDATE_BACKENDS}, got {update_backend!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if max_concurrent_catchups < 1:
            raise ValueError(f"max_concurrent_catchups must be >= 1, got {max_concurrent_catchups}")
        self.bucket_bytes, self.timeout_s, self.join_timeout_s = bucket_bytes, timeout_s, join_timeout_s
        self.namespace, self.request_timeout_s = namespace, request_timeout_s
        self.update_backend = update_backend
        self._store_host = StoreHost(host, port, timeout_s=timeout_s)
        self._address = self._store_host.address
        self._lock = threading.Lock()
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._flats: dict[int, FlatVersion] = {}
        self._broadcasting: set[int] = set()
        self._slots = threading.BoundedSemaphore(max_concurrent_catchups)
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._workers: set[threading.Thread] = set()
        self._stats = {"dispatched": 0, "served": 0, "refused": 0, "failed": 0, "skipped": 0}
        self._closed = False

    @property
    def address(self) -> StoreAddress:
        """Where cells connect (`cells.transport.store.connect`)."""
        return self._address

    # -- versions ------------------------------------------------------------------------
    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keeps `version` as a contiguous CPU copy of `tensors` (the caller may go on
        mutating its own). Putting a held version again is a no-op if the content is bitwise
        identical and a ValueError otherwise: cells may already hold the first one."""
        version = self._check_version(version)
        # One flat copy with every bucket's checksum computed once: broadcasts send straight
        # from it; `copy` holds views of it (unsupported dtypes fail here, not at send).
        _check_tensors(tensors)
        flat = FlatVersion.from_tensors(version, tensors, self.bucket_bytes)
        copy = flat.tensors()
        with self._lock:
            held = self._versions.get(version)
            if held is None:
                self._versions[version] = copy
                self._flats[version] = flat
                return
        if not _same_content(held, copy):
            raise ValueError(f"version {version} is already held with different content: "
                             "a version's weights never change, put it under a new number")

    def versions(self) -> list[int]:
        """The held versions, ascending."""
        with self._lock:
            return sorted(self._versions)

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The held tensors of `version` (a new dict of the host's own tensors: read them, do
        not modify them; they are what every cell receives). KeyError if not held."""
        return dict(self._held(version))

    def drop(self, version: int) -> None:
        """Retires `version`; transfers already under way finish with their own reference."""
        with self._lock:
            if version not in self._versions:
                raise KeyError(self._not_held(version))
            del self._versions[version]
            self._flats.pop(version, None)

    def nbytes(self, version: int) -> int:
        """Host memory that `version` occupies, in bytes."""
        return sum(t.numel() * t.element_size() for t in self._held(version).values())

    def _held(self, version: int) -> dict[str, torch.Tensor]:
        with self._lock:
            tensors = self._versions.get(version)
            if tensors is None:
                raise KeyError(self._not_held(version))
            return tensors

    def _not_held(self, version: object) -> str:
        """The refusal message; the caller holds `_lock`."""
        return f"version {version} is not held (held: {sorted(self._versions)})"

    @staticmethod
    def _check_version(version: int) -> int:
        # The bucket footer carries the version as u64, and JSON carries it as a number.
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        return version

    # -- broadcast -----------------------------------------------------------------------
    def broadcast(self, version: int, receivers: list[str],
                  receiver_ranks: dict[str, int] | None = None) -> BroadcastResult:
        """Broadcasts held `version` to `receivers` (cell ids); blocks until each is delivered
        or given up. `receiver_ranks` (cell → ranks, the scheduler's answer to the publish)
        names the cells that receive through their engine's own collective (ranks > 0, each
        calling `await_update_group`): they are served over update groups
        (`_send_update_groups`) on a second thread while the others (each calling
        `receive_broadcast`) get the bucketed broadcast, so neither kind waits out the other's
        transfer. Cells in `result.failed` catch up with `fetch_version`. KeyError if the version is not held, ValueError if it is
        being or has been broadcast already (its keys are single-use)."""
        ranks = _receiver_ranks(receivers, receiver_ranks)
        embedded = [c for c in receivers if ranks.get(c, 0) == 0]
        engine_cells = list(dict.fromkeys(c for c in receivers if ranks.get(c, 0) > 0))
        with self._lock:
            tensors, flat = self._versions.get(version), self._flats.get(version)
            if tensors is None or flat is None:
                raise KeyError(self._not_held(version))
            if version in self._broadcasting:
                raise ValueError(f"version {version} is being broadcast already")
            self._broadcasting.add(version)
        t0 = time.monotonic()
        try:
            if engine_cells:
                self._check_group_unused(version)
            result = self._send_both(version, flat, tensors, embedded, engine_cells, ranks)
        finally:
            with self._lock:
                self._broadcasting.discard(version)
        result.seconds = time.monotonic() - t0
        log.info("version %d broadcast: %d delivered, %d failed in %.2fs (attempts: %d)",
                 version, len(result.delivered), len(result.failed), result.seconds, result.num_attempts)
        for cell, why in result.failed.items():
            log.warning("version %d: %s has no verified copy (%s); it must catch up", version, cell, why)
        return result

    def _send_both(self, version: int, flat: FlatVersion, tensors: dict[str, torch.Tensor], embedded: list[str],
                   engine_cells: list[str], ranks: dict[str, int]) -> BroadcastResult:
        """The bucketed broadcast here, the update groups on a thread; one merged result.
        Without engine-collective cells this is exactly the bucketed broadcast."""
        if not engine_cells:
            return self._send_embedded(version, flat, embedded)
        box: dict[str, object] = {}

        def groups() -> None:
            try:
                box["result"] = self._send_update_groups(version, tensors, engine_cells, ranks)
            except BaseException as e:  # re-raised by the caller's thread
                box["error"] = e

        t = threading.Thread(target=groups, name=f"versions-ug-{version}", daemon=True)
        t.start()
        try:
            result = self._send_embedded(version, flat, embedded) if embedded else BroadcastResult(version)
        finally:
            t.join()  # bounded: every wait of the update groups has its own deadline
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        _merge(result, box["result"])  # type: ignore[arg-type]
        return result

    def _send_embedded(self, version: int, flat: FlatVersion, receivers: list[str]) -> BroadcastResult:
        """The bucketed broadcast to cells that receive it themselves (`receive_broadcast`)."""
        # Its own connection: gloo's rendezvous blocks on the store client it is given.
        sender = WeightSender(
            connect(self._address, timeout_s=self.timeout_s),
            bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
            join_timeout_s=self.join_timeout_s, namespace=f"{self.namespace}/bc",
        )
        return sender.send_version(version, flat, receivers)

    def _check_group_unused(self, version: int) -> None:
        store = connect(self._address, timeout_s=self.timeout_s)
        if store.check([_group_key(self.namespace, version, "plan", 0)]):
            raise ValueError(f"version {version} was already sent over update groups: "
                             "catch cells up with fetch_version")

    # -- update groups (cells whose engine receives through its own collective) -----------
    def _send_update_groups(self, version: int, tensors: dict[str, torch.Tensor], cells: list[str],
                            ranks: dict[str, int]) -> BroadcastResult:
        """Sends `version` to `cells` over update groups: a fresh group per attempt, with the
        members that said they are ready; after a failed attempt the members that asked for a
        retry get another group, up to `GROUP_ATTEMPTS`. Every wait is bounded: a cell that is
        late, dead, or whose engine never joins ends in `failed`, never hangs the trainer."""
        t0 = time.monotonic()
        result = BroadcastResult(version)
        store = connect(self._address, timeout_s=self.timeout_s)
        key = lambda *p: _group_key(self.namespace, version, *p)  # noqa: E731
        try:
            buckets = _update_plan(tensors, self.bucket_bytes)
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
            backend, keep, error = self._run_update_group(store, key, version, attempt, members, ranks,
                                                          buckets, tensors, retry_s)
            if error and backend is not None:  # fail the members still waiting on us now
                discard(backend, keep, broken=True)
            pending = settle_reports(store, key, result, members, attempt, error, settle_s)
            if not error and backend is not None:  # members have the tail: close cleanly
                discard(backend, keep, broken=False)
            attempt, join_wait = attempt + 1, 0.0  # retries wrote ready/{attempt+1} already
        for c in pending:
            result.failed[c] = f"gave up after {GROUP_ATTEMPTS} attempts"
        set_json(store, key("plan", attempt), {"members": [], "retry_within_s": 0})  # release waiters
        result.seconds = time.monotonic() - t0
        return result

    def _run_update_group(self, store: Store, key, version: int, attempt: int, members: list[str],
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
            group = UpdateGroup(self._address.host, master.port, offset, world, name, self.update_backend,
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
        device = torch.device("cuda" if self.update_backend == "nccl" else "cpu")
        backend, keep = None, []
        try:
            group = UpdateGroup(self._address.host, master.port, 0, world, name, self.update_backend)
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

    # -- catch-up server -----------------------------------------------------------------
    def start(self) -> None:
        """Starts serving catch-ups on a daemon thread; a second call does nothing."""
        if self._closed:
            raise RuntimeError("VersionHost is closed")
        if self._server is None:
            self._server = threading.Thread(target=self._serve, daemon=True, name="versions-catchup")
            self._server.start()

    def catchup_stats(self) -> dict[str, int]:
        """Counts of catch-up tickets: dispatched to a worker; served (verified by the cell);
        refused (version not held, or a malformed request); failed (transport, checksum or a
        dead client); skipped (no request within `request_timeout_s`)."""
        with self._lock:
            return dict(self._stats)

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stops the server, waits at most `grace_s` for catch-ups in flight (the rest end on
        their own op timeouts), and closes the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + grace_s
        if self._server is not None:
            self._server.join(timeout=max(0.0, deadline - time.monotonic()) + 2 * _ERROR_BACKOFF_S)
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(w.is_alive() for w in workers):
            log.warning("closing with catch-ups still in flight; they end within their op timeout")
        self._store_host.close()

    def __enter__(self) -> VersionHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self._stats[what] += 1

    def _serve(self) -> None:
        """Watches the ticket counter; dispatches each ticket, in order, once its request is
        there and a slot is free; skips tickets whose request never comes."""
        store: Store | None = None
        pending: dict[int, float] = {}  # ticket -> when it was first seen taken
        seen = 0
        while not self._stop.is_set():
            try:
                if store is None:
                    store = connect(self._address, timeout_s=self.timeout_s)
                issued = store.add(_catchup_key(self.namespace, "next"), 0)
                now = time.monotonic()
                for n in range(seen + 1, issued + 1):
                    pending[n] = now
                seen = max(seen, issued)
                self._dispatch_ready(store, pending, now)
            except Exception as e:  # the store went away (closing) or a transient error
                if self._stop.is_set():
                    break
                log.warning("catch-up server: store error: %s", e)
                store = None
                self._stop.wait(_ERROR_BACKOFF_S)
                continue
            self._stop.wait(POLL_S)

    def _dispatch_ready(self, store: Store, pending: dict[int, float], now: float) -> None:
        for n in sorted(pending):
            if self._stop.is_set():
                return
            req_key = _catchup_key(self.namespace, "req", n)
            if not store.check([req_key]):
                if now - pending[n] > self.request_timeout_s:
                    del pending[n]
                    self._count("skipped")
                    log.warning("catch-up ticket %d: no request within %.1fs, skipped", n, self.request_timeout_s)
                continue
            if not self._slots.acquire(blocking=False):
                return  # all slots busy: later tickets wait too, so order holds
            try:
                request = get_json(store, req_key)
            except BaseException:  # the store failed: the ticket stays pending for the retry
                self._slots.release()
                raise
            del pending[n]
            self._start_worker(n, request)  # releases the slot when the transfer ends
            store.delete_key(req_key)

    def _start_worker(self, ticket: int, request: object) -> None:
        cell, version, refusal = "?", None, None
        if isinstance(request, dict) and isinstance(request.get("version"), int):
            cell, version = str(request.get("cell", "?")), request["version"]
        else:
            refusal = f"malformed catch-up request: {request!r:.200}"
        tensors = None
        if refusal is None:
            # The reference is taken now: a drop from here on does not affect this transfer.
            with self._lock:
                tensors = self._versions.get(version)
                if tensors is None:
                    refusal = self._not_held(version)
        w = threading.Thread(
            target=self._serve_ticket, args=(ticket, cell, version, tensors, refusal),
            daemon=True, name=f"versions-catchup-{ticket}",
        )
        with self._lock:
            self._stats["dispatched"] += 1
            self._workers.add(w)
        w.start()

    def _serve_ticket(self, ticket: int, cell: str, version: int | None,
                      tensors: dict[str, torch.Tensor] | None, refusal: str | None) -> None:
        """One catch-up: header, then the version. Failures end here, logged and counted."""
        outcome = "failed"
        channel = None
        try:
            store = connect(self._address, timeout_s=self.timeout_s)
            channel = PairChannel(store, _catchup_key(self.namespace, ticket), 0,
                                  timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s)
            if refusal is not None or tensors is None:
                channel.send_json({"ok": False, "error": refusal})
                outcome = "refused"
                log.info("catch-up ticket %d (%s): refused: %s", ticket, cell, refusal)
                return
            t0 = time.monotonic()
            channel.send_json({"ok": True})
            send_version_p2p(channel, version, tensors, bucket_bytes=self.bucket_bytes)
            outcome = "served"
            log.info("catch-up ticket %d: %s has version %d (%.2fs)", ticket, cell, version, time.monotonic() - t0)
        except TransferError as e:
            log.warning("catch-up ticket %d (%s, version %s) failed: %s", ticket, cell, version, e)
        except Exception:
            log.exception("catch-up ticket %d (%s, version %s) failed", ticket, cell, version)
        finally:
            if channel is not None:
                channel.close()
            self._count(outcome)
            with self._lock:
                self._workers.discard(threading.current_thread())
            self._slots.release()


# -- cell side -----------------------------------------------------------------------------

def fetch_version(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    staging: dict[str, torch.Tensor] | None = None,
    timeout_s: float = 30.0,
    namespace: str = "versions",
    connect_timeout_s: float | None = None,
) -> dict[str, torch.Tensor]:
    """Catches this cell up to `version` from the trainer's version host.

    Returns the tensors (in `staging`, mutated even on failure, or freshly allocated) only
    after every bucket matched its CRC32. Raises VersionUnavailable if the host does not
    hold the version, ChecksumError on a corrupt bucket, TransferError on any transport
    failure or deadline. `timeout_s` bounds each op; `connect_timeout_s` (default
    `timeout_s`) bounds the wait for the host to take the ticket up, which includes time
    queued behind other cells' catch-ups. Blocks: call it off the engine's step loop.
    """
    store = _connect(address, timeout_s)
    channel = None
    try:
        ticket = store.add(_catchup_key(namespace, "next"), 1)
        set_json(store, _catchup_key(namespace, "req", ticket), {"cell": cell_id, "version": version})
        wait_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        try:
            channel = PairChannel(store, _catchup_key(namespace, ticket), 1,
                                  timeout_s=timeout_s, connect_timeout_s=wait_s)
        except TransferError as e:
            raise TransferError(f"version host {address.host}:{address.port} did not take up "
                                f"catch-up ticket {ticket} within {wait_s}s: {e}") from e
        header = channel.recv_json()
        if not isinstance(header, dict):
            raise TransferError(f"{channel.name}: malformed catch-up header {header!r:.200}")
        if not header.get("ok"):
            raise VersionUnavailable(f"{cell_id}: {header.get('error') or 'refused by the version host'}")
        got, tensors = recv_version_p2p(channel, staging=staging)
        if got != version:
            raise TransferError(f"{channel.name}: asked for version {version}, host sent {got}")
        return tensors
    except dist.DistError as e:  # the host's store went away with the trainer
        raise TransferError(f"version host {address.host}:{address.port}: store unreachable: {e}") from e
    finally:
        if channel is not None:
            channel.close()
        del store  # a TCPStore client's socket closes with the object


def receive_broadcast(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    staging: dict[str, torch.Tensor] | None = None,
    timeout_s: float = 30.0,
    join_timeout_s: float = 60.0,
    namespace: str = "versions",
) -> Received:
    """Receives `version` from the host's `broadcast` naming this cell.

    Returns `Received(tensors, None)` once every bucket matched its CRC32, or
    `Received(None, reason)` (not planned in, sender gone, checksum mismatch, store
    unreachable...): the cell then keeps its old version and catches up with
    `fetch_version`. Never raises for a transfer failure. `staging` is mutated even on
    failure.
    """
    try:
        store = _connect(address, timeout_s)
    except TransferError as e:
        log.warning("%s: version %d broadcast: %s", cell_id, version, e)
        return Received(None, str(e))
    try:
        rx = WeightReceiver(store, cell_id, timeout_s=timeout_s, join_timeout_s=join_timeout_s,
                            namespace=f"{namespace}/bc")
        if rx.receive_version(version, staging):
            return Received(rx.received_tensors(), None)
        reason = rx.last_error or "not received"
        log.warning("%s: version %d broadcast not received: %s", cell_id, version, reason)
        return Received(None, reason)
    finally:
        del store


def await_update_group(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    attempt: int = 0,
    wait_s: float = 60.0,
    timeout_s: float = 30.0,
    namespace: str = "versions",
) -> tuple[UpdateAssignment | None, str | None]:
    """Tells the trainer that this cell waits for attempt `attempt` of `version`'s update
    group (after a failed attempt: asks for a retry), and waits at most `wait_s` for the plan.

    Returns `(assignment, None)` when this cell is a member: its engine then joins
    `assignment.group` and receives `assignment.buckets`, and the cell reports with
    `report_update`. Otherwise `(None, reason)` (not planned in, trainer gone, malformed plan,
    store unreachable): the cell keeps its version and catches up with `fetch_version`.
    Never raises for a transfer failure. Blocks: call it off the engine's step loop.
    """
    try:
        store = _connect(address, timeout_s)
    except TransferError as e:
        return None, str(e)
    key = lambda *p: _group_key(namespace, version, *p)  # noqa: E731
    try:
        set_json(store, key("ready", attempt, cell_id), {})
        plan = wait_json(store, key("plan", attempt), wait_s)
        if plan is None:
            return None, f"no update plan for attempt {attempt} within {wait_s:.1f}s (trainer gone)"
        if cell_id not in plan["members"]:
            return None, f"not in the update plan of attempt {attempt}"
        spec = get_json(store, key("spec", attempt, cell_id))
        group = UpdateGroup(**spec["group"])
        buckets = tuple(BucketSpec.from_dict(b) for b in spec["buckets"])
        return UpdateAssignment(version, attempt, group, buckets, float(plan["retry_within_s"])), None
    except dist.DistError as e:  # the trainer's store went away with the trainer
        return None, f"store unreachable: {e}"
    except (KeyError, TypeError, ValueError) as e:  # a trainer speaking another protocol
        return None, f"malformed update plan: {e!r}"
    finally:
        del store


def report_update(
    address: StoreAddress,
    cell_id: str,
    assignment: UpdateAssignment,
    ok: bool,
    reason: str = "",
    *,
    timeout_s: float = 30.0,
    namespace: str = "versions",
) -> bool:
    """Tells the trainer how this cell's engine ended `assignment` (final: a cell that wants
    another attempt calls `await_update_group` with the next attempt instead). Returns False
    if the trainer could not be told (it then counts the cell as silent)."""
    try:
        store = _connect(address, timeout_s)
        key = _group_key(namespace, assignment.version, "result", assignment.attempt, cell_id)
        set_json(store, key, {"ok": bool(ok), "reason": reason[:500]})
        return True
    except (TransferError, dist.DistError) as e:
        log.warning("%s: version %d: could not report the update: %s", cell_id, assignment.version, e)
        return False


def _connect(address: StoreAddress, timeout_s: float) -> Store:
    try:
        return connect(address, timeout_s=timeout_s)
    except dist.DistError as e:
        raise TransferError(f"version host {address.host}:{address.port}: store unreachable: {e}") from e

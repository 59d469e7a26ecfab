"""A version host: unretired weight versions in host memory, broadcast to rollout cells and
served point to point to cells that missed it. The cell that computed a version publishes it
(cells/training/publisher.py) over the trainer's store.

One line: put → broadcast (the host = rank 0 of a fresh group) → cells outside it take a
catch-up ticket → header → buckets → verdict → drop when the version is retired.

Two kinds of receivers share one publish (`broadcast(version, receivers, receiver_ranks)`):
- embedded cells (`update_ranks` 0) join the bucketed, CRC-checked broadcast of
  cells/transport/broadcast.py;
- cells whose engine receives through its own collective (SGLang: `update_ranks` > 0) are
  served afterwards over update groups (update_groups.py).
Cells that missed it catch up point to point (catchup_server.py). The cell side of all three,
and the store keys they share, are in cells/transport/receive.py.

Guarantees:
- A held version never changes: `put` keeps its own contiguous CPU copy, and a second `put`
  of that version must be bitwise identical. A transfer holds its own reference, so a
  `drop` during a catch-up or broadcast of that version does not disturb it.
- Catch-ups are served in ticket order, a bounded number at once; a dead client fails only
  its own transfer (catchup_server.py).
- The cell side returns only tensors whose every bucket matched its CRC32; any other outcome
  is an exception (`fetch_version`) or a reason (`receive_broadcast`), never a partial
  version.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from cells.transport.broadcast import SPLIT_OP_BYTES, BroadcastResult, WeightSender
from cells.transport.buckets import DEFAULT_BUCKET_BYTES, FlatVersion, byte_view
from cells.transport.catchup_server import REQUEST_TIMEOUT_S, CatchupServer
from cells.transport.store import StoreAddress, StoreHost, connect
from cells.transport.update_groups import UPDATE_BACKENDS, UpdateGroupSender

log = logging.getLogger("cellflip.versions")

CLOSE_GRACE_S = 5.0
"""How long `close` waits for catch-ups in flight before leaving them to their own timeouts."""


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


class VersionHost:
    """Holds unretired weight versions and serves them to rollout cells.

    Lives in the process that holds the versions (a cell, or a test). `address`: where cells
    reach the host (cells/transport/receive.py) with `receive_broadcast` (when named in a
    broadcast), `await_update_group` (the same, for cells whose engine receives through its
    own collective) or `fetch_version` (any time, once `start()` has run). `put`/`get`/`drop`
    may be called from any thread while broadcasts and catch-ups run.
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
        op_bytes: int = SPLIT_OP_BYTES,
        store: StoreAddress | None = None,
    ) -> None:
        """`op_bytes`: payload bytes per collective op of a broadcast in the split format.
        `update_backend`: the collective of update groups (engine-collective cells): "gloo"
        sends from host memory; "nccl" stages each bucket on this process's GPU first.
        `store`: rendezvous on this store (another process's, e.g. the trainer's) instead of
        hosting one: a cell publishes a version it holds through the trainer's store, which
        carries only keys and rendezvous; the bytes go from this process to the cells."""
        if update_backend not in UPDATE_BACKENDS:
            raise ValueError(f"update_backend must be one of {UPDATE_BACKENDS}, got {update_backend!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if op_bytes <= 0:
            raise ValueError(f"op_bytes must be > 0, got {op_bytes}")
        if max_concurrent_catchups < 1:
            raise ValueError(f"max_concurrent_catchups must be >= 1, got {max_concurrent_catchups}")
        self.bucket_bytes, self.timeout_s, self.join_timeout_s = bucket_bytes, timeout_s, join_timeout_s
        self.namespace, self.request_timeout_s = namespace, request_timeout_s
        self.update_backend, self.op_bytes = update_backend, op_bytes
        self._store_host = StoreHost(host, port, timeout_s=timeout_s) if store is None else None
        self._address = self._store_host.address if store is None else store
        self._lock = threading.Lock()
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._flats: dict[int, FlatVersion] = {}
        self._broadcasting: set[int] = set()
        self._groups = UpdateGroupSender(self._address, namespace=namespace, bucket_bytes=bucket_bytes,
                                         timeout_s=timeout_s, join_timeout_s=join_timeout_s, backend=update_backend)
        self._catchups = CatchupServer(self._address, self._lookup, namespace=namespace, bucket_bytes=bucket_bytes,
                                       timeout_s=timeout_s, request_timeout_s=request_timeout_s,
                                       max_concurrent=max_concurrent_catchups)
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
        (update_groups.py) on a second thread while the others (each calling
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
                self._groups.check_unused(version)
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
                box["result"] = self._groups.send(version, tensors, engine_cells, ranks)
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
            join_timeout_s=self.join_timeout_s, namespace=f"{self.namespace}/bc", op_bytes=self.op_bytes,
        )
        return sender.send_version(version, flat, receivers)

    # -- catch-up server -----------------------------------------------------------------
    def start(self) -> None:
        """Starts serving catch-ups on a daemon thread; a second call does nothing."""
        if self._closed:
            raise RuntimeError("VersionHost is closed")
        self._catchups.start()

    def catchup_stats(self) -> dict[str, int]:
        """Counts of catch-up tickets (`CatchupServer.stats`)."""
        return self._catchups.stats()

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stops the server, waits at most `grace_s` for catch-ups in flight (the rest end on
        their own op timeouts), and closes the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._catchups.stop(grace_s)
        if self._store_host is not None:
            self._store_host.close()

    def __enter__(self) -> VersionHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lookup(self, version: int) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """A catch-up's reference to `version`, taken now (a later drop does not affect it)."""
        with self._lock:
            tensors = self._versions.get(version)
            return (tensors, None) if tensors is not None else (None, self._not_held(version))

"""The version host's catch-up server: serves held versions point to point to cells that
missed a broadcast (the client side is `cells.transport.receive.fetch_version`).

One line: a cell takes a ticket → writes its request → the server, in ticket order, starts a
worker once a slot is free → header → the version's buckets → the cell verifies them.

Tickets are dispatched in ticket order as their requests appear, at most `max_concurrent`
at once, each on its own thread with its own store connection. A ticket whose request does
not appear within `request_timeout_s` (a client that died between `add` and `set`) is
skipped, and it never delays later tickets meanwhile; a client that dies mid-transfer fails
only its own worker, within one op timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed import Store

from cells.transport.catchup import send_version_p2p
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.receive import catchup_key
from cells.transport.store import POLL_S, StoreAddress, connect, get_json

log = logging.getLogger("cellflip.versions")

REQUEST_TIMEOUT_S = 5.0
"""How long a taken ticket may stay without its request before the server skips it: a live
client writes it right after `add`, so only a dead one takes this long."""

_ERROR_BACKOFF_S = 0.5
"""Pause of the server loop after a store error, so that a gone store is not hammered."""

Lookup = Callable[[int], tuple[dict[str, torch.Tensor] | None, str | None]]
"""`lookup(version)` -> (the held tensors, None) or (None, why it is refused)."""


class CatchupServer:
    """Serves catch-up tickets from the host's store at `address` on a daemon thread."""

    def __init__(self, address: StoreAddress, lookup: Lookup, *, namespace: str, bucket_bytes: int,
                 timeout_s: float, request_timeout_s: float, max_concurrent: int) -> None:
        self._address, self._lookup = address, lookup
        self.namespace, self.bucket_bytes = namespace, bucket_bytes
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._workers: set[threading.Thread] = set()
        self._stats = {"dispatched": 0, "served": 0, "refused": 0, "failed": 0, "skipped": 0}

    def start(self) -> None:
        """Starts serving on a daemon thread; a second call does nothing."""
        if self._server is None:
            self._server = threading.Thread(target=self._serve, daemon=True, name="versions-catchup")
            self._server.start()

    def stats(self) -> dict[str, int]:
        """Counts of catch-up tickets: dispatched to a worker; served (verified by the cell);
        refused (version not held, or a malformed request); failed (transport, checksum or a
        dead client); skipped (no request within `request_timeout_s`)."""
        with self._lock:
            return dict(self._stats)

    def stop(self, grace_s: float) -> None:
        """Stops the server and waits at most `grace_s` for catch-ups in flight (the rest end
        on their own op timeouts)."""
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
                issued = store.add(catchup_key(self.namespace, "next"), 0)
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
            req_key = catchup_key(self.namespace, "req", n)
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
            tensors, refusal = self._lookup(version)
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
            channel = PairChannel(store, catchup_key(self.namespace, ticket), 0,
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

"""Point-to-point transfers between two cells over a stateless 2-rank group.

One line: join under a fresh prefix → ops, each with its own deadline → close; after any
error the channel is discarded and a fresh one opened under a new name.

The group is built directly (`ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore` of
the hosting cell's store), never through `init_process_group`: a cell talks to many peers over
its life, one short-lived pair at a time, and must not own a global world. Metadata travels
as JSON bytes in length-prefixed uint8 tensors; nothing here pickles.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from cells.transport.store import poll_sleeps

MAX_JSON_BYTES = 64 << 20

TENSOR_BYTES = {"sent": 0, "received": 0}
"""Tensor bytes this process posted to or received through torch.distributed, by every
transfer in cells/ (pair channels, broadcasts, training state): what a process that must hold
no model state (the trainer) reports."""


def count_bytes(what: str, tensor: torch.Tensor) -> None:
    TENSOR_BYTES["sent" if what == "send" else "received"] += tensor.numel() * tensor.element_size()
"""Largest JSON message a receiver accepts; a larger length header means a confused peer."""


class TransferError(RuntimeError):
    """A transfer failed or ran past its deadline. The channel or group that raised it is
    broken for good: open a fresh one under a new name."""


def _nccl_error_mode() -> None:
    # The default TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears the whole process down when a
    # communicator fails or times out; a rollout cell must survive a failed transfer and keep
    # decoding. Mode 2 (CleanUpOnly) aborts the failed communicator and surfaces the error to
    # the waiting call instead. It is read when the process group is constructed.
    mode = os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if mode in ("1", "3"):
        warnings.warn(
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING={mode} kills this process when a transfer fails; "
            "cellflip expects 2 (abort the communicator, raise in the caller)",
            stacklevel=3,
        )


def join_group(
    store: Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    timeout_s: float,
    connect_timeout_s: float,
    device: torch.device,
    abort_key: str | None = None,
):
    """Joins a stateless group of `size` ranks rendezvousing under `prefix` in `store`.

    A join counter in the store comes first, so that waiting for late peers is bounded by
    `connect_timeout_s` while the backend itself gets the (usually shorter) per-op timeout,
    and so that a reused prefix fails loudly instead of mixing two attempts' connections.
    The wait ends early once `abort_key` is set in `store` (the attempt was called off).
    """
    pstore = PrefixStore(prefix, store)
    try:
        joined = pstore.add("joined", 1)
        if joined > size:
            raise TransferError(f"group {prefix!r} already has {size} members: use a fresh name per attempt")
        sleeps = poll_sleeps(time.monotonic() + connect_timeout_s)
        while joined < size:
            if not next(sleeps):
                raise TransferError(f"group {prefix!r}: {joined}/{size} ranks joined within {connect_timeout_s}s")
            if abort_key is not None and store.check([abort_key]):
                raise TransferError(f"group {prefix!r}: called off ({abort_key})")
            joined = pstore.add("joined", 0)
    except TransferError:
        raise
    except Exception as e:  # the hosting cell's store is gone
        raise TransferError(f"group {prefix!r}: rendezvous store unreachable: {e}") from e
    timeout = timedelta(seconds=timeout_s)
    try:
        if device.type == "cuda":
            _nccl_error_mode()
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return ProcessGroupNCCL(pstore, rank, size, opts)
        return ProcessGroupGloo(pstore, rank, size, timeout)
    except Exception as e:  # a peer that joined and then died leaves the mesh incomplete
        raise TransferError(f"group {prefix!r}: backend setup failed: {e}") from e


def discard(backend, keepalive: list, *, broken: bool = True) -> None:
    """Drops a backend without blocking the caller, who must drop its own references to it
    at once (`backend = None`; a frame kept alive by a raised exception counts too): whoever
    drops the last reference runs the destructor, which joins gloo's threads and closes its
    sockets (15-20 ms here, the dropping thread blocked), and the reaper's comes after its
    shutdown. `broken=False` says every op completed: the buffers are let go at once.

    A gloo worker still inside a timed-out collective holds the backend's destructor until
    the group timeout; the buffers of ops still posted must outlive it, or a late byte from
    the peer lands in freed memory. Both go to a thread that waits that out. It is not a
    daemon: a backend destroyed while the interpreter exits aborts the process ("terminate
    called without an active exception"), so exit waits for it, at most one group timeout.
    """

    def reap(box: list):
        b, keep = box
        box.clear()  # this frame holds the only references the thread has
        try:
            # NCCL: abort frees a failed communicator and unblocks its kernels, shutdown ends
            # a healthy one cleanly; gloo: both return at once, the destructor does the work.
            b.abort() if broken else b.shutdown()
        except Exception:
            pass
        if not broken:
            keep = None  # every op completed: no late byte can land in these any more
        del b  # the destructor (if the caller let go), then the buffers it might still write
        del keep

    box = [backend, keepalive]
    threading.Thread(target=reap, args=(box,), daemon=False, name="transport-reap").start()


def wait_work(work, timeout_s: float, what: str) -> None:
    """Waits for one backend op at most `timeout_s`; TransferError if it failed or timed out.

    The bound is enforced here, per op, not only by the group: P2P ops can sit unmatched
    forever after a peer aborts, and the caller is a cell that must go on decoding.
    """
    try:
        ok = work.wait(timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransferError(f"{what} failed: {e}") from e
    if ok is False:
        raise TransferError(f"{what} timed out after {timeout_s}s")


class Transfer:
    """One posted send or recv. `wait()` blocks at most the channel's op timeout."""

    __slots__ = ("_channel", "_work", "tensor", "_what", "_done", "_key")

    def __init__(self, channel: PairChannel, work, tensor: torch.Tensor, what: str, key: int) -> None:
        self._channel, self._work, self.tensor, self._what = channel, work, tensor, what
        self._done, self._key = False, key

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """The transferred tensor once the op completed; TransferError (channel broken) if it
        failed or did not complete within `timeout_s` (default: the channel's op timeout)."""
        if self._done:
            return self.tensor
        ch = self._channel
        if ch._broken is not None:
            raise TransferError(f"{ch.name}: channel broken earlier ({ch._broken})")
        try:
            wait_work(self._work, ch.timeout_s if timeout_s is None else timeout_s, f"{ch.name}: {self._what}")
        except TransferError as e:
            ch._fail(str(e))
            raise
        self._done = True
        ch._inflight.pop(self._key, None)
        return self.tensor


class PairChannel:
    """A two-rank transfer channel between this cell and one peer.

    Both sides construct it with the same `name` (unique per pair and attempt, e.g.
    ``mig/{request}/{epoch}/{attempt}``) and opposite ranks; construction blocks until the
    peer has joined or `connect_timeout_s` passes. Ops match in posting order.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        rank: int,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        device: str | torch.device = "cpu",
    ) -> None:
        assert rank in (0, 1), rank
        self.name, self.rank, self.peer = name, rank, 1 - rank
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self._inflight: dict[int, torch.Tensor] = {}  # posted op number -> its buffer
        self._num_posted = 0
        self._broken: str | None = None
        self._backend = join_group(
            store, f"pair/{name}/", rank, 2,
            timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, device=self.device,
        )

    # -- raw tensors ---------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor) -> Transfer:
        """Posts a send of `tensor` (made contiguous); the caller must not modify it until
        the returned transfer's `wait()` returns."""
        return self._post("send", tensor.contiguous())

    def irecv(self, out: torch.Tensor) -> Transfer:
        """Posts a receive into `out` (contiguous, shape and dtype agreed beforehand)."""
        assert out.is_contiguous(), "recv buffers must be contiguous"
        return self._post("recv", out)

    def send_tensor(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.isend(tensor).wait(timeout_s)

    def recv_tensor(self, out: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Receives into `out` and returns it."""
        return self.irecv(out).wait(timeout_s)

    def send_many(self, tensors: list[torch.Tensor]) -> None:
        """Posts every send at once (the peer's receives match in order), then waits each."""
        for tr in [self.isend(t) for t in tensors]:
            tr.wait()

    def recv_many(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tr.wait() for tr in [self.irecv(o) for o in outs]]

    # -- JSON metadata -------------------------------------------------------------------
    def send_json(self, obj: object) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        header = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.send_many([header, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)])

    def recv_json(self, max_bytes: int = MAX_JSON_BYTES) -> object:
        n = int(self.recv_tensor(torch.empty(1, dtype=torch.int64, device=self.device)).item())
        if not 0 < n <= max_bytes:
            self._fail(f"bad JSON length {n}")
            raise TransferError(f"{self.name}: bad JSON length header {n} (limit {max_bytes})")
        payload = self.recv_tensor(torch.empty(n, dtype=torch.uint8, device=self.device))
        try:
            return json.loads(bytes(payload.cpu().numpy()))
        except ValueError as e:
            self._fail("malformed JSON")
            raise TransferError(f"{self.name}: malformed JSON from peer: {e}") from e

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Releases the group. Never blocks on a peer; safe to call twice."""
        if self._backend is not None:
            abandoned = list(self._inflight.values())  # ops still posted: buffers outlive the backend
            discard(self._backend, abandoned, broken=self._broken is not None or bool(abandoned))
        self._backend, self._inflight = None, {}
        if self._broken is None:
            self._broken = "closed"

    def __enter__(self) -> PairChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, what: str, tensor: torch.Tensor) -> Transfer:
        if self._broken is not None:
            raise TransferError(f"{self.name}: channel broken earlier ({self._broken})")
        try:
            fn = self._backend.send if what == "send" else self._backend.recv
            work = fn([tensor], self.peer, 0)
            count_bytes(what, tensor)
        except Exception as e:
            self._fail(f"posting {what} failed: {e}")
            raise TransferError(f"{self.name}: posting {what} failed: {e}") from e
        self._num_posted += 1
        tr = Transfer(self, work, tensor, what, self._num_posted)
        self._inflight[tr._key] = tensor
        return tr

    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
        self.close()


def measure_raw_p2p(
    channel: PairChannel, nbytes: int, *, chunk_bytes: int | None = None, repeats: int = 3
) -> float:
    """Send bandwidth rank 0 → rank 1 in GB/s (1e9 bytes per second); both ranks call it with
    the same arguments and get the same number back.

    `chunk_bytes=None` sends one contiguous tensor; otherwise the same bytes go as posted
    chunks of that size (how KV blocks travel), so the gap between the two is per-op overhead.
    Best of `repeats` after one warm-up; the clock includes one tiny ack round trip.
    """
    buf = torch.ones(nbytes, dtype=torch.uint8, device=channel.device)
    chunks = [buf] if chunk_bytes is None else list(buf.split(chunk_bytes))
    flag = torch.zeros(1, dtype=torch.uint8, device=channel.device)
    best = float("inf")
    for r in range(repeats + 1):
        if channel.rank == 0:
            channel.recv_tensor(flag)  # the peer has posted every receive
            t0 = time.perf_counter()
            channel.send_many(chunks)
            channel.recv_tensor(flag)
            dt = time.perf_counter() - t0
            if r > 0:
                best = min(best, dt)
        else:
            posted = [channel.irecv(c) for c in chunks]
            channel.send_tensor(flag)
            for tr in posted:
                tr.wait()
            channel.send_tensor(flag)
    result = torch.tensor([nbytes / best / 1e9 if channel.rank == 0 else 0.0], dtype=torch.float64)
    if channel.rank == 0:
        channel.send_tensor(result.to(channel.device))
        return float(result.item())
    return float(channel.recv_tensor(result.to(channel.device)).item())

"""Live KV migration, cell side (Llumnix-style, pipelined, fenced).

One line: reserve → copy while decoding → stop, copy the tail → import, commit → resume → free.

The source hosts the pair group's rendezvous (its own store) and is rank 0. Transfers run on
a migration thread; every engine operation (export, pause, import, resume, free) runs on the
cell's loop thread through `on_engine`, so decoding of every other request — and of the
migrating one until the stop — goes on between rounds. The destination commits the new owner
at the scheduler (a compare-and-set) *before* it resumes; a source that hears nothing aborts
the migration at the scheduler first and resumes only if that abort won, so exactly one cell
ever continues the request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cells.client import Refused, SchedulerClient
from cells.engine.records import EngineError, RequestSnapshot
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.store import StoreAddress, connect
from scheduler.config import MigrationConfig
from scheduler.failpoints import failpoint
from scheduler.protocol import (
    AbortMigrationRequest,
    CommitRequest,
    MigrateInCmd,
    MigrateOutCmd,
    MigrationEvent,
    Tail,
)

log = logging.getLogger("cellflip.migration")

OnEngine = Callable[[Callable[[], Any]], Any]
Quiesce = Callable[[], contextlib.AbstractContextManager]
"""`with quiesce():` pauses this cell's decoding for the block (bounded by the agent)."""

CHUNK_BYTES = 64 << 20
"""Largest KV message of a copy round: bounds how long one export holds the engine lock."""


class StagingBuffers:
    """Receive buffers for KV copy rounds, kept for the next round. A fresh buffer is
    page-faulted in while the bytes arrive, which halves a receive's rate on a CPU cell
    (loopback gloo: about 4 GB/s into a warm buffer, 2 into a fresh one). At most `keep`
    buffers are kept; `prealloc_numel` floats are faulted in up front."""

    def __init__(self, prealloc_numel: int = 0, keep: int = 4) -> None:
        self._free: list[torch.Tensor] = [torch.zeros(prealloc_numel)] if prealloc_numel > 0 else []
        self._lock = threading.Lock()
        self.keep = keep

    def take(self, shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(a float32 tensor of `shape` to receive into, its backing buffer for `give`)."""
        n = math.prod(shape)
        with self._lock:  # by position: `==` on tensors compares elements
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(n)
        return buf[:n].view(shape), buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    def sizes(self) -> list[int]:
        """Numels of the kept buffers (tests, diagnostics)."""
        with self._lock:
            return sorted(b.numel() for b in self._free)


@dataclass
class Outcome:
    """What the agent needs to know when a migration thread ends."""

    request_id: str
    migration_id: str
    role: str  # "source" | "destination"
    result: str  # committed | aborted | refused | failed
    epoch: int | None = None
    num_generated: int = 0
    bytes: int = 0
    reason: str = ""
    transfer_s: float = 0.0
    """Wall time spent inside KV tensor sends (source) — what the link bandwidth bounds."""
    total_s: float = 0.0
    """From the command to the outcome."""
    marks: dict = field(default_factory=dict)
    """Wall-clock instants of the stop-and-copy steps (for post-mortems and the bench)."""


def _kv_header(start: int, data: torch.Tensor, ids_from: int, ids: list[int]) -> dict:
    return {"kind": "kv", "start": start, "shape": list(data.shape), "token_ids_from": ids_from, "token_ids": ids}


class MigrationSender:
    """Source side of one migration."""

    def __init__(self, cmd: MigrateOutCmd, *, cell_id: str, incarnation: str, store, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, flushed: Callable[[], int],
                 synced: Callable[[], int] | None = None, quiesce: Quiesce = contextlib.nullcontext,
                 peek: OnEngine | None = None):
        self.cmd, self.cell_id, self.incarnation = cmd, cell_id, incarnation
        self.store, self.client, self.cfg, self.on_engine = store, client, cfg, on_engine
        self.quiesce = quiesce
        self.peek = peek or on_engine
        """Reads of the request's length without the engine lock (a stale count is harmless
        where it is used): on a busy source each lock acquisition waits out a decode step."""
        self.flushed = flushed  # at the stop: generated tokens the store holds; no more syncs after
        self.synced = synced  # the same count, read-only
        self.bytes = 0
        self.transfer_s = 0.0
        self.marks: dict[str, float] = {}

    def run(self) -> Outcome:
        t0 = time.perf_counter()
        out = self._run()
        out.transfer_s, out.total_s, out.marks = self.transfer_s, time.perf_counter() - t0, self.marks
        return out

    def _run(self) -> Outcome:
        rid, mid = self.cmd.request_id, self.cmd.migration_id
        paused = False
        ch = None
        try:
            ch = PairChannel(self.store, f"mig/{mid}", 0, timeout_s=self.cfg.transfer_timeout_s,
                             connect_timeout_s=self.cfg.transfer_timeout_s)
            self.marks["joined"] = time.time()
            num_tokens = self.peek(lambda e: e.request_length(rid)[0])  # the destination grows past it
            ch.send_json({"request_id": rid, "num_tokens": num_tokens})
            reply = ch.recv_json()
            if not reply.get("reserved"):
                return self._abort_at_scheduler(rid, mid, paused, "destination refused the reservation")
            self.marks["reserved"] = time.time()
            sent_blocks, sent_ids = 0, 0
            for _ in range(self.cfg.max_copy_rounds):
                # Each round sends the blocks completed since the last one, while decoding
                # goes on; once fewer than stop_copy_blocks remain, the stop-and-copy takes them.
                moved = self._copy_round(ch, rid, sent_blocks, sent_ids)
                if moved is None:
                    break
                sent_blocks, sent_ids = moved
                failpoint("migrate.after_copy_round")
            else:
                if self.cfg.on_round_limit == "abort" and self.cfg.max_copy_rounds > 0:
                    ch.send_json({"kind": "abort"})
                    return self._abort_at_scheduler(rid, mid, paused, "round limit")
            self.marks["copied"] = time.time()
            paused = True  # from here the request may stand still: an abort must let it go
            self._settle(rid)
            # Stop-and-copy: only the blocks and records added since the last round travel.
            self.marks["stop_requested"] = time.time()
            stopped = self.on_engine(lambda e: self._stop(e, rid, sent_blocks, sent_ids))
            self.marks["stopped"] = time.time()
            failpoint("migrate.before_stop_copy")
            data, snap = stopped
            # One message and one tensor: the tail blocks, the ids and records added since
            # the last round, and the request's state — nothing that grows with the context.
            ids_tail, snap.token_ids, snap.token_ids_from = snap.token_ids, [], 0
            ch.send_json({**_kv_header(sent_blocks, data, sent_ids, ids_tail), "kind": "final",
                          "snapshot": snap.to_dict()})
            if data.numel():
                t = time.perf_counter()
                ch.send_tensor(data)
                self.transfer_s += time.perf_counter() - t
                self.bytes += data.numel() * data.element_size()
            self.marks["tail_sent"] = time.time()
            failpoint("migrate.after_stop_copy")
            result = ch.recv_json()
            self.marks["result"] = time.time()
            if result.get("committed") is not None:
                failpoint("migrate.before_source_free")
                self.on_engine(lambda e: e.release(rid))
                return Outcome(rid, mid, "source", "committed", epoch=int(result["committed"]), bytes=self.bytes)
            return self._abort_at_scheduler(rid, mid, paused, str(result.get("aborted", "destination aborted")))
        except (TransferError, OSError, RuntimeError, EngineError) as e:
            # EngineError: the request finished or was dropped under us; nothing to hand over
            log.warning("migration %s of %s failed at the source: %s", mid, rid, e)
            return self._abort_at_scheduler(rid, mid, paused, f"transfer: {e}")
        finally:
            if ch is not None:
                ch.close()

    def _copy_round(self, ch: PairChannel, rid: str, sent_blocks: int, sent_ids: int) -> tuple[int, int] | None:
        """Send the blocks completed since the last round, in messages of at most CHUNK_BYTES;
        decoding goes on between messages. Each message is quiesced from its export to the end
        of its send: one wait for the decode step in flight, then the copy has the cores."""
        first = sent_blocks
        while True:
            def grab(e, start=sent_blocks, ids_from=sent_ids):
                done = e.num_complete_blocks(rid)
                if done - start < max(self.cfg.stop_copy_blocks, 1):
                    return None
                end = min(done, start + max(1, CHUNK_BYTES // e.pool.bytes_per_block()))
                snap = e.snapshot(rid, records_from=1 << 62, token_ids_from=ids_from)
                return end, done, e.export_kv(rid, start, end), snap.token_ids

            with self.quiesce():
                got = self.on_engine(grab)
                if got is None:
                    return (sent_blocks, sent_ids) if sent_blocks > first else None
                end, done, data, ids = got
                self._send_kv(ch, sent_blocks, data, sent_ids, ids)
            sent_blocks, sent_ids = end, sent_ids + len(ids)
            if end >= done:
                return sent_blocks, sent_ids

    def _settle(self, rid: str, timeout_s: float = 1.0) -> None:
        """Before stopping, let the request decode one more token and its client see it: a
        bulk copy round pauses the source for a moment, and the stop should cut a stream that
        is flowing, not one that is already paused by the copy. The engine pauses the request
        right after that token (`pause_after`), so the stop does not wait out a decode step
        whose token would only travel in the tail."""
        if self.synced is None:
            return
        n, prompt_len = self.peek(lambda e: e.request_length(rid))
        self.on_engine(lambda e: e.pause_after(rid, n + 1) if hasattr(e, "pause_after") else None)
        target = n - prompt_len + 1
        deadline = time.monotonic() + timeout_s
        while self.synced() < target and time.monotonic() < deadline:
            time.sleep(0.001)

    def _send_kv(self, ch: PairChannel, start: int, data: torch.Tensor, ids_from: int, ids: list[int]) -> None:
        ch.send_json(_kv_header(start, data, ids_from, ids))
        if data.numel():
            # The receiver says when its buffer is posted, so the timed part is the link alone.
            # JSON, like every control message: an abort sent instead parses as one (a raw
            # 1-byte flag met by a JSON header is a size mismatch that gloo aborts the process on).
            reply = ch.recv_json()
            if not isinstance(reply, dict) or not reply.get("ready"):
                raise TransferError(f"destination did not take the round: {str(reply)[:200]}")
            t = time.perf_counter()
            ch.send_tensor(data)
            self.transfer_s += time.perf_counter() - t
            self.bytes += data.numel() * data.element_size()

    def _stop(self, e, rid: str, sent_blocks: int, sent_ids: int) -> tuple[torch.Tensor, RequestSnapshot]:
        e.pause(rid)
        end = e.num_kv_blocks(rid)
        data = e.export_kv(rid, sent_blocks, end)
        snap = e.snapshot(rid, records_from=self.flushed(), token_ids_from=sent_ids)
        return data, snap

    def _abort_at_scheduler(self, rid: str, mid: str, paused: bool, reason: str) -> Outcome:
        """Resume only if the abort wins the compare-and-set against the destination's commit."""
        try:
            self.client.abort_migration(mid, AbortMigrationRequest(self.cell_id, self.incarnation, reason))
        except Refused as e:
            if e.reason == "committed":
                self.on_engine(lambda eng: eng.release(rid))
                return Outcome(rid, mid, "source", "committed", bytes=self.bytes, reason="commit won")
            log.warning("abort of migration %s refused: %s", mid, e.reason)
        except Exception as e:  # scheduler unreachable: keep the request paused, it is not ours to resume
            log.warning("abort of migration %s could not reach the scheduler: %s", mid, e)
            return Outcome(rid, mid, "source", "failed", bytes=self.bytes, reason=f"{reason}; abort unsent")
        if paused:
            self.on_engine(lambda eng: eng.unpause(rid))
        return Outcome(rid, mid, "source", "aborted", bytes=self.bytes, reason=reason)


class MigrationReceiver:
    """Destination side of one migration."""

    def __init__(self, cmd: MigrateInCmd, *, cell_id: str, incarnation: str, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, on_commit: Callable[[str, int, int], None],
                 quiesce: Quiesce = contextlib.nullcontext, staging: StagingBuffers | None = None):
        self.cmd, self.cell_id, self.incarnation = cmd, cell_id, incarnation
        self.client, self.cfg, self.on_engine, self.on_commit = client, cfg, on_engine, on_commit
        self.quiesce = quiesce
        self.staging = staging or StagingBuffers(keep=0)
        self.bytes = 0
        self.marks: dict[str, float] = {}

    def run(self) -> Outcome:
        t0 = time.perf_counter()
        out = self._run()
        out.total_s, out.marks = time.perf_counter() - t0, self.marks
        return out

    def _run(self) -> Outcome:
        cmd = self.cmd
        rid, mid = cmd.request_id, cmd.migration_id
        ch = None
        reserved = False
        try:
            store = connect(StoreAddress(cmd.src_address.split(":")[0], cmd.src_store_port),
                            timeout_s=self.cfg.transfer_timeout_s)
            ch = PairChannel(store, f"mig/{mid}", 1, timeout_s=self.cfg.transfer_timeout_s,
                             connect_timeout_s=self.cfg.transfer_timeout_s)
            hello = ch.recv_json()
            reserved = self.on_engine(lambda e: e.reserve(rid, int(hello["num_tokens"]), self.cfg.headroom_blocks))
            ch.send_json({"reserved": bool(reserved)})
            if not reserved:
                return Outcome(rid, mid, "destination", "refused", reason="no room")
            ids: list[int] = []
            while True:
                msg = ch.recv_json()
                if msg["kind"] == "abort":
                    raise TransferError("source aborted the migration")
                failpoint("migrate.transfer")
                if msg["token_ids_from"] != len(ids):
                    raise TransferError(f"token ids out of order: {msg['token_ids_from']} != {len(ids)}")
                ids.extend(msg["token_ids"])
                data, backing = self.staging.take(msg["shape"])
                if data.numel():
                    if msg["kind"] == "final":
                        ch.recv_tensor(data)
                    else:  # a copy round: post the receive, then tell the sender to go
                        with self.quiesce():
                            pending = ch.irecv(data)
                            ch.send_json({"ready": True})
                            pending.wait()
                    self.bytes += data.numel() * data.element_size()
                if msg["kind"] == "final":
                    break
                self.on_engine(lambda e, m=msg, d=data: e.import_kv(rid, m["start"], d))
                self.staging.give(backing)  # import_kv copied it into the pool
            self.marks["final_received"] = time.time()
            snap = RequestSnapshot.from_dict(msg["snapshot"])
            snap.token_ids, snap.token_ids_from = ids, 0

            def install(e, start=msg["start"], d=data):
                if d.numel():
                    e.import_kv(rid, start, d)
                e.import_request(snap)  # paused: nothing decodes it before the commit

            self.on_engine(install)
            self.staging.give(backing)
            self.marks["imported"] = time.time()
            failpoint("migrate.before_commit")
            num_generated = snap.num_tokens - snap.prompt_len
            tail = Tail(start=snap.records_from, records=[tuple(r) for r in snap.records])
            epoch = self._commit(mid, CommitRequest(self.cell_id, self.incarnation, rid, cmd.epoch,
                                                    num_generated, tail, path="kv"))
        except Refused as e:
            self._drop(rid, reserved)
            if ch is not None:
                self._tell(ch, {"aborted": e.reason})
                ch.close()
            return Outcome(rid, mid, "destination", "aborted", bytes=self.bytes, reason=e.reason)
        except Exception as e:
            log.warning("migration %s of %s failed at the destination: %s", mid, rid, e)
            self._drop(rid, reserved)
            if ch is not None:
                self._tell(ch, {"aborted": str(e)[:200]})
                ch.close()
            return Outcome(rid, mid, "destination", "failed", bytes=self.bytes, reason=str(e)[:200])
        # Committed: this cell owns the request at `epoch`. Resume, then tell the source to free.
        try:
            self.marks["committed"] = time.time()
            failpoint("migrate.after_commit")
            self.on_engine(lambda e: (self.on_commit(rid, epoch, num_generated), e.resume(rid)))
            self.marks["resumed"] = time.time()
            self._tell(ch, {"committed": epoch})
        finally:
            ch.close()
        return Outcome(rid, mid, "destination", "committed", epoch=epoch, num_generated=num_generated,
                       bytes=self.bytes)

    def _commit(self, mid: str, req: CommitRequest) -> int:
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        while True:
            try:
                return self.client.commit(mid, req)
            except Refused as e:
                # "gap": the source's last synced tokens have not landed yet; they will.
                if e.reason != "gap" or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _drop(self, rid: str, reserved: bool) -> None:
        if reserved:
            self.on_engine(lambda e: e.release(rid))

    @staticmethod
    def _tell(ch: PairChannel, obj: dict) -> None:
        try:
            ch.send_json(obj)
        except TransferError:
            pass  # the source decides through the scheduler, not through us


def migration_event(o: Outcome) -> dict:
    return MigrationEvent(migration_id=o.migration_id, outcome=o.result, path="kv", bytes=o.bytes).to_dict()

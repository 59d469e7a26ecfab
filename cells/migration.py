"""Live KV migration, cell side (Llumnix-style, pipelined, fenced).

One line: reserve → copy while decoding → stop, copy the tail → import, commit → resume → free.

The source hosts the pair group's rendezvous (its own store) and is rank 0. Transfers run on
a migration thread; every engine operation (export, pause, import, resume, free) runs under
the cell's engine lock through `on_engine`, so decoding of every other request — and of the
migrating one until the stop — goes on between rounds. A copy-round message is exported and
sent within one lock hold, into receives the destination posted before it said ready: the
link then runs at its idle speed instead of sharing the CPU with decode steps, and decoding
pauses for that send (a few ms per tens of MiB), not for the peer. The destination commits
the new owner at the scheduler (a compare-and-set) *before* it resumes; a source that hears
nothing aborts the migration at the scheduler first and resumes only if that abort won, so
exactly one cell ever continues the request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cells.client import Refused, SchedulerClient
from cells.engine.interface import EngineError, RequestSnapshot
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

ROUND_BYTES = 64 << 20
"""Largest copy-round message. Its export and send run under the engine lock, so that decoding
and the link do not fight over the CPU: this bounds that pause (64 MiB is a few tens of ms at
loopback speed, about one decode step of a long context)."""

CHUNK_BYTES = 2 << 20
"""Largest KV tensor of a round. Each chunk is exported, sent and dropped before the next, so
the allocator hands the next export the pages the last one touched: faulting in fresh pages
costs several times the copy itself, and a whole 64 MiB export would fault them all."""

LOCKED_WAIT_FLOOR_S = 2.0
LOCKED_WAIT_BPS = 50e6
"""A transfer op under the engine lock waits at most FLOOR + bytes / BPS (and never past the
transfer timeout): the peer is ready before the sender takes the lock, so only a stalled peer
runs into it, and decoding on this cell must not wait out that peer's whole transfer timeout."""


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
    downtime_s: float | None = None
    reason: str = ""
    transfer_s: float = 0.0
    """Wall time spent inside KV tensor sends (source) — what the link bandwidth bounds."""
    total_s: float = 0.0
    """From the command to the outcome."""
    marks: dict = field(default_factory=dict)
    """Wall-clock instants of the stop-and-copy steps (for post-mortems and the bench)."""


def _split(n: int, per: int) -> list[int]:
    return [min(per, n - i) for i in range(0, n, per)]


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(name: str) -> torch.dtype:
    # A receive posted smaller than what arrives makes gloo abort the process: the element
    # type travels with the shape, from a fixed list.
    if name not in _DTYPES:
        raise TransferError(f"unsupported KV dtype {name!r}")
    return _DTYPES[name]


class _Staging:
    """The destination's receive buffer, reused by every round of one migration. It is
    written through (zeroed) when it grows, before the receives are posted: pages faulted in
    by the incoming bytes would slow the link, and the source holds its engine lock then."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def grow(self, nbytes: int) -> None:
        if self.buf.numel() < nbytes:
            self.buf = torch.zeros(nbytes, dtype=torch.uint8)

    def views(self, shape: list[int], chunks: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        if len(shape) < 3 or min(shape) < 0 or sum(chunks) != shape[2] or min(chunks, default=1) < 1:
            raise TransferError(f"bad round layout: shape {shape}, chunks {chunks}")
        per_block = math.prod(shape[:2] + shape[3:]) * dtype.itemsize
        self.grow(per_block * shape[2])
        out, off = [], 0
        for n in chunks:
            out.append(self.buf[off:off + per_block * n].view(dtype).view(*shape[:2], n, *shape[3:]))
            off += per_block * n
        return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _kv_header(start: int, data: torch.Tensor, ids_from: int, ids: list[int]) -> dict:
    return {"kind": "kv", "start": start, "shape": list(data.shape), "dtype": _dtype_name(data),
            "token_ids_from": ids_from, "token_ids": ids}


class MigrationSender:
    """Source side of one migration."""

    def __init__(self, cmd: MigrateOutCmd, *, cell_id: str, incarnation: str, store, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, flushed: Callable[[], int],
                 synced: Callable[[], int] | None = None):
        self.cmd, self.cell_id, self.incarnation = cmd, cell_id, incarnation
        self.store, self.client, self.cfg, self.on_engine = store, client, cfg, on_engine
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
            # The destination joins once it has reserved room and faulted in its receive
            # buffer, so from here on it answers at once.
            ch = PairChannel(self.store, f"mig/{mid}", 0, timeout_s=self.cfg.transfer_timeout_s,
                             connect_timeout_s=self.cfg.transfer_timeout_s)
            self.marks["joined"] = time.time()
            # One engine-lock hold plans the first round, sends it with the hello, waits for the
            # destination's go and moves the blocks: one decode-step wait, not three.
            opened = self.on_engine(lambda e: self._open(e, ch, rid))
            if opened is None:
                return self._abort_at_scheduler(rid, mid, paused, "destination refused the reservation")
            sent, plan = opened
            sent_blocks, sent_ids, rounds = 0, 0, 0
            while sent is not None:
                sent_blocks, sent_ids = sent["start"] + sent["shape"][2], sent["token_ids_from"] + len(sent["token_ids"])
                header = plan["next"]
                if sent["caught_up"]:  # a round ends once it has every block complete when it began
                    rounds += 1
                    failpoint("migrate.after_copy_round")
                    if header is not None and rounds >= self.cfg.max_copy_rounds:
                        if self.cfg.on_round_limit == "abort":
                            ch.send_json({"kind": "abort"})
                            return self._abort_at_scheduler(rid, mid, paused, "round limit")
                        break  # the stop-and-copy takes the rest
                if header is None:
                    break
                # Copy while decoding: the destination posts its receives first, then one
                # engine-lock hold exports and sends the message and plans the next.
                ch.send_json(header)
                if not self._ready(ch):
                    raise TransferError("destination did not post the next round")
                plan, sent = self.on_engine(lambda e, h=header: self._send_round(e, ch, rid, h)), header
            self.marks["copied"] = time.time()
            if sent_blocks:  # a copy round held the lock: let the stream flow before the stop
                self._settle(plan["settle_target"])
            # Stop-and-copy: only the blocks and records added since the last round travel.
            self.marks["stop_requested"] = time.time()
            stopped = self.on_engine(lambda e: self._stop(e, rid, sent_blocks, sent_ids))
            paused = True
            self.marks["stopped"] = time.time()
            failpoint("migrate.before_stop_copy")
            data, snap = stopped
            # One message and one tensor: the tail blocks, the ids and records added since
            # the last round, and the request's state — nothing that grows with the context.
            ids_tail, snap.token_ids, snap.token_ids_from = snap.token_ids, [], 0
            ch.send_json({**_kv_header(sent_blocks, data, sent_ids, ids_tail), "kind": "final",
                          "snapshot": snap.to_dict()})
            if data.numel():
                ch.send_tensor(data)
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

    def _plan(self, e, rid: str, start: int, ids_from: int) -> dict:
        """Under the engine lock: the request's length and the next copy-round message, or
        None once fewer than stop_copy_blocks complete blocks are left to send."""
        n, prompt_len = e.request_length(rid)
        done = e.num_complete_blocks(rid)
        plan = {"num_tokens": n, "settle_target": n - prompt_len + 1, "next": None}
        if done - start < max(self.cfg.stop_copy_blocks, 1):
            return plan
        per_block = e.pool.bytes_per_block()
        end = min(done, start + max(1, ROUND_BYTES // per_block))
        per_chunk = max(1, CHUNK_BYTES // per_block)
        layout = e.export_kv(rid, start, start)  # the block shape and type, no data
        shape = list(layout.shape)
        shape[2] = end - start
        ids = e.snapshot(rid, records_from=1 << 62, token_ids_from=ids_from).token_ids
        plan["next"] = {"kind": "kv", "start": start, "shape": shape, "dtype": _dtype_name(layout),
                        "chunks": _split(end - start, per_chunk), "token_ids_from": ids_from, "token_ids": ids,
                        "caught_up": end >= done}
        return plan

    def _open(self, e, ch: PairChannel, rid: str) -> tuple[dict | None, dict] | None:
        """Under the engine lock: the hello with the first round's header, the destination's
        answer, the first round. None if the destination has no room."""
        plan = self._plan(e, rid, 0, 0)
        header = plan["next"] if self.cfg.max_copy_rounds > 0 else None
        timeout_s = self._locked_timeout(0)
        ch.send_json({"request_id": rid, "num_tokens": plan["num_tokens"], "round": header}, timeout_s)
        if not self._ready(ch, timeout_s):
            return None
        if header is None:
            return None, plan
        return header, self._send_round(e, ch, rid, header)

    def _locked_timeout(self, nbytes: int) -> float:
        return min(self.cfg.transfer_timeout_s, LOCKED_WAIT_FLOOR_S + nbytes / LOCKED_WAIT_BPS)

    def _send_round(self, e, ch: PairChannel, rid: str, header: dict) -> dict:
        """Under the engine lock: export and send one planned message, chunk by chunk, into
        receives the destination posted before it said ready; then plan the next one."""
        start = header["start"]
        for n in header["chunks"]:
            data = e.export_kv(rid, start, start + n)
            nbytes = data.numel() * data.element_size()
            t = time.perf_counter()
            ch.send_tensor(data, timeout_s=self._locked_timeout(nbytes))
            self.transfer_s += time.perf_counter() - t
            self.bytes += nbytes
            start += n
            del data  # its pages go to the next chunk's export
        return self._plan(e, rid, start, header["token_ids_from"] + len(header["token_ids"]))

    @staticmethod
    def _ready(ch: PairChannel, timeout_s: float | None = None) -> bool:
        """The destination's answer to a round header: True once its receives are posted,
        False if it has no room. Every answer is JSON, failures included: a reply of another
        size than the receive posted for it makes gloo abort the whole process."""
        reply = ch.recv_json(timeout_s=timeout_s)
        if "aborted" in reply:
            raise TransferError(f"destination aborted: {reply['aborted']}")
        return bool(reply.get("ready"))

    def _settle(self, target: int, timeout_s: float = 1.0) -> None:
        """Before stopping, let the request decode one more token and its client see it: a
        copy round pauses decoding (and the sync loop) while it holds the engine lock, and the
        stop should cut a stream that is flowing, not one that is already paused by the copy."""
        if self.synced is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.synced() < target and time.monotonic() < deadline:
            time.sleep(0.001)

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
            self.on_engine(lambda eng: eng.resume(rid) if rid in eng.requests else None)
        return Outcome(rid, mid, "source", "aborted", bytes=self.bytes, reason=reason)


class MigrationReceiver:
    """Destination side of one migration."""

    def __init__(self, cmd: MigrateInCmd, *, cell_id: str, incarnation: str, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, on_commit: Callable[[str, int, int], None]):
        self.cmd, self.cell_id, self.incarnation = cmd, cell_id, incarnation
        self.client, self.cfg, self.on_engine, self.on_commit = client, cfg, on_engine, on_commit
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
            # Reserve and fault in the first round's receive buffer before joining: the source
            # sends the hello from inside an engine-lock hold and waits for the answer there.
            staging, refused = _Staging(), ""
            try:
                reserved = self.on_engine(lambda e: e.reserve(rid, cmd.reserve_tokens, 0))
            except EngineError as e:
                reserved, refused = False, str(e)
            if reserved:
                kv_bytes = self.on_engine(lambda e: e.pool.bytes_per_block() * e.pool.blocks_for(cmd.reserve_tokens))
                staging.grow(min(kv_bytes, ROUND_BYTES))
            store = connect(StoreAddress(cmd.src_address.split(":")[0], cmd.src_store_port),
                            timeout_s=self.cfg.transfer_timeout_s)
            ch = PairChannel(store, f"mig/{mid}", 1, timeout_s=self.cfg.transfer_timeout_s,
                             connect_timeout_s=self.cfg.transfer_timeout_s)
            hello = ch.recv_json()
            if hello.get("request_id") != rid:
                raise TransferError(f"hello for {hello.get('request_id')!r}, expected {rid!r}")
            if not reserved:
                ch.send_json({"ready": False})
                ch.close()
                if refused:
                    log.warning("migration %s of %s failed at the destination: %s", mid, rid, refused)
                    return Outcome(rid, mid, "destination", "failed", reason=refused[:200])
                return Outcome(rid, mid, "destination", "refused", reason="no room")
            ids: list[int] = []
            msg = hello.get("round")
            if msg is None:
                ch.send_json({"ready": True})  # reserved; no copy round to post
            while True:
                if msg is not None:  # a copy round: post every chunk's receive, then say ready
                    failpoint("migrate.transfer")
                    if msg["token_ids_from"] != len(ids):
                        raise TransferError(f"token ids out of order: {msg['token_ids_from']} != {len(ids)}")
                    chunks = staging.views(msg["shape"], msg["chunks"], _dtype(msg.get("dtype", "float32")))
                    pending = [ch.irecv(c) for c in chunks]
                    ch.send_json({"ready": True})
                    for tr in pending:
                        tr.wait()
                    ids.extend(msg["token_ids"])
                    self.bytes += sum(c.numel() * c.element_size() for c in chunks)

                    def put(e, start=msg["start"], chunks=chunks):
                        for c in chunks:
                            e.import_kv(rid, start, c)
                            start += c.shape[2]

                    self.on_engine(put)
                msg = ch.recv_json()
                if msg["kind"] == "abort":
                    raise TransferError("source aborted the migration")
                if msg["kind"] == "final":
                    break
            failpoint("migrate.transfer")
            if msg["token_ids_from"] != len(ids):
                raise TransferError(f"token ids out of order: {msg['token_ids_from']} != {len(ids)}")
            ids.extend(msg["token_ids"])
            data = torch.empty(msg["shape"], dtype=_dtype(msg.get("dtype", "float32")))
            if data.numel():
                ch.recv_tensor(data)
                self.bytes += data.numel() * data.element_size()
            self.marks["final_received"] = time.time()
            snap = RequestSnapshot.from_dict(msg["snapshot"])
            snap.token_ids, snap.token_ids_from = ids, 0

            def install(e, start=msg["start"], d=data):
                if d.numel():
                    e.import_kv(rid, start, d)
                e.import_request(snap)  # paused: nothing decodes it before the commit

            self.on_engine(install)
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
    return MigrationEvent(migration_id=o.migration_id, outcome=o.result, path="kv", bytes=o.bytes,
                          downtime_s=o.downtime_s).to_dict()

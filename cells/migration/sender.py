"""The source side of a live KV migration.

One line: host the pair group → reserve at the destination → copy rounds while decoding →
stop, send the tail and the request's state → the destination's verdict → free (committed),
or abort at the scheduler and resume only if that abort won.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from cells.client import Refused, SchedulerClient
from cells.engine.base import KVHandover
from cells.engine.records import EngineError, RequestSnapshot
from cells.migration.common import (
    CANCELLED,
    CHUNK_BYTES,
    Cancellable,
    Cancelled,
    OnEngine,
    Outcome,
    Quiesce,
)
from cells.migration.messages import (
    Abort,
    Final,
    Hello,
    KVRound,
    Ready,
    Reservation,
    Verdict,
    receive,
    send,
)
from cells.transport.p2p import PairChannel, TransferError
from scheduler.contract.config.scheduler import MigrationConfig
from scheduler.contract.failpoints import failpoint
from scheduler.contract.protocol import AbortMigrationRequest, MigrateOutCmd

log = logging.getLogger("cellflip.migration")


def _dtype(data: torch.Tensor) -> str:
    """The wire name of a KV export's dtype (the engine's export is a host tensor: a GPU
    engine's comes as a pinned host copy, which gloo sends as it is)."""
    return str(data.dtype).removeprefix("torch.")


def _tell_abort(ch: PairChannel | None) -> None:
    """Tell a destination waiting for the next message that the migration is off (best effort)."""
    if ch is None:
        return
    try:
        send(ch, Abort())
    except TransferError:
        pass  # it finds out through the scheduler


class MigrationSender(Cancellable):
    """Source side of one migration."""

    def __init__(self, cmd: MigrateOutCmd, *, cell_id: str, incarnation: str, store, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, flushed: Callable[[], int],
                 synced: Callable[[], int] | None = None, quiesce: Quiesce = contextlib.nullcontext,
                 peek: OnEngine | None = None):
        super().__init__()
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
        self.sends: list[list] = []  # [wall instant the send began, bytes] per KV message
        self.delivered = 0  # generated tokens synced to the store at the stop
        self._paused = False
        """Past the stop: the request may stand still here, and an abort must let it go."""

    def run(self) -> Outcome:
        t0 = time.perf_counter()
        out = self._run()
        out.transfer_s, out.total_s, out.marks = self.transfer_s, time.perf_counter() - t0, self.marks
        out.sends, out.num_generated = self.sends, self.delivered
        return out

    def _run(self) -> Outcome:
        rid, mid = self.cmd.request_id, self.cmd.migration_id
        ch = None
        try:
            ch = PairChannel(self.store, f"mig/{mid}", 0, timeout_s=self.cfg.transfer_timeout_s,
                             connect_timeout_s=self.cfg.transfer_timeout_s)
            self.marks["joined"] = time.time()
            if not self._reserve(ch, rid):
                return self._abort_at_scheduler(rid, mid, "destination refused the reservation")
            sent = self._copy_rounds(ch, rid)
            if sent is None:
                send(ch, Abort())
                return self._abort_at_scheduler(rid, mid, "round limit")
            verdict = self._stop_and_copy(ch, rid, *sent)
            if verdict.committed is not None:
                failpoint("migrate.before_source_free")
                self.on_engine(lambda e: e.release(rid))
                return Outcome(rid, mid, "source", "committed", epoch=verdict.committed, bytes=self.bytes)
            return self._abort_at_scheduler(rid, mid, verdict.aborted or "destination aborted")
        except Cancelled:
            _tell_abort(ch)
            return self._abort_at_scheduler(rid, mid, CANCELLED)
        except (TransferError, OSError, RuntimeError, EngineError) as e:
            # EngineError: the request finished or was dropped under us; nothing to hand over
            log.warning("migration %s of %s failed at the source: %s", mid, rid, e)
            return self._abort_at_scheduler(rid, mid, f"transfer: {e}")
        finally:
            if ch is not None:
                ch.close()

    def _reserve(self, ch: PairChannel, rid: str) -> bool:
        num_tokens = self.peek(lambda e: e.request_length(rid)[0])  # the destination grows past it
        send(ch, Hello(rid, num_tokens))
        reserved = receive(ch, Reservation).reserved
        if reserved:
            self.marks["reserved"] = time.time()
        return reserved

    def _copy_rounds(self, ch: PairChannel, rid: str) -> tuple[int, int] | None:
        """Each round sends the blocks completed since the last one, while decoding goes on;
        once fewer than stop_copy_blocks remain, the stop-and-copy takes them. Returns (blocks,
        token ids) sent, or None at the round limit with `on_round_limit: abort`."""
        sent_blocks, sent_ids = 0, 0
        for _ in range(self.cfg.max_copy_rounds):
            moved = self._copy_round(ch, rid, sent_blocks, sent_ids)
            if moved is None:
                break
            sent_blocks, sent_ids = moved
            failpoint("migrate.after_copy_round")
        else:
            if self.cfg.on_round_limit == "abort" and self.cfg.max_copy_rounds > 0:
                return None
        self.marks["copied"] = time.time()
        return sent_blocks, sent_ids

    def _stop_and_copy(self, ch: PairChannel, rid: str, sent_blocks: int, sent_ids: int) -> Verdict:
        """Stop the request and send what was added since the last round: one message and one
        tensor (the tail blocks, the ids and records added since the last round, and the
        request's state — nothing that grows with the context). Returns the destination's
        verdict (`committed` epoch, or `aborted` reason)."""
        self.check_cancel()
        self._paused = True  # from here the request may stand still: an abort must let it go
        self._settle(rid)
        self.marks["stop_requested"] = time.time()
        data, snap = self.on_engine(lambda e: self._stop(e, rid, sent_blocks, sent_ids))
        self.marks["stopped"] = time.time()
        failpoint("migrate.before_stop_copy")
        self.check_cancel()
        ids_tail, snap.token_ids, snap.token_ids_from = snap.token_ids, [], 0
        send(ch, Final(sent_blocks, list(data.shape), sent_ids, ids_tail, snap, dtype=_dtype(data)))
        if data.numel():
            self._send_tensor(ch, data)
        self.marks["tail_sent"] = time.time()
        failpoint("migrate.after_stop_copy")
        verdict = receive(ch, Verdict)
        self.marks["result"] = time.time()
        return verdict

    def _copy_round(self, ch: PairChannel, rid: str, sent_blocks: int, sent_ids: int) -> tuple[int, int] | None:
        """Send the blocks completed since the last round, in messages of at most CHUNK_BYTES;
        decoding goes on between messages. Each message is quiesced from its export to the end
        of its send: one wait for the decode step in flight, then the copy has the cores."""
        first = sent_blocks
        while True:
            self.check_cancel()

            def grab(e, start=sent_blocks, ids_from=sent_ids):
                done = e.num_complete_blocks(rid)
                if done - start < max(self.cfg.stop_copy_blocks, 1):
                    return None
                end = min(done, start + max(1, CHUNK_BYTES // e.kv_bytes_per_block()))
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
        self.on_engine(lambda e: e.pause_after(rid, n + 1))
        target = n - prompt_len + 1
        deadline = time.monotonic() + timeout_s
        while self.synced() < target and time.monotonic() < deadline:
            time.sleep(0.001)

    def _send_kv(self, ch: PairChannel, start: int, data: torch.Tensor, ids_from: int, ids: list[int]) -> None:
        send(ch, KVRound(start, list(data.shape), ids_from, ids, dtype=_dtype(data)))
        if data.numel():
            # The receiver says when its buffer is posted, so the timed part is the link alone.
            # JSON, like every control message: an abort sent instead parses as one (a raw
            # 1-byte flag met by a JSON header is a size mismatch that gloo aborts the process on).
            if not receive(ch, Ready).ready:
                raise TransferError("destination did not take the round (it aborted)")
            self._send_tensor(ch, data)

    def _send_tensor(self, ch: PairChannel, data: torch.Tensor) -> None:
        nbytes = data.numel() * data.element_size()
        self.sends.append([time.time(), nbytes])
        t = time.perf_counter()
        ch.send_tensor(data)
        self.transfer_s += time.perf_counter() - t
        self.bytes += nbytes

    def _stop(self, e: KVHandover, rid: str, sent_blocks: int, sent_ids: int) -> tuple[torch.Tensor, RequestSnapshot]:
        e.pause_request(rid)
        end = e.num_kv_blocks(rid)
        data = e.export_kv(rid, sent_blocks, end)
        self.delivered = self.flushed()
        snap = e.snapshot(rid, records_from=self.delivered, token_ids_from=sent_ids)
        return data, snap

    def _abort_at_scheduler(self, rid: str, mid: str, reason: str) -> Outcome:
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
        if self._paused:
            self.on_engine(lambda eng: eng.unpause(rid))
        return Outcome(rid, mid, "source", "aborted", bytes=self.bytes, reason=reason)

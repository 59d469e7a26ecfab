"""The destination side of a live KV migration.

One line: join the source's pair group → reserve → import each copy round → the final
message (tail blocks, records, the request's state) → install, paused → commit at the
scheduler → resume → tell the source to free.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from cells.client import Refused, SchedulerClient
from cells.engine.records import RequestSnapshot
from cells.migration.common import (
    CANCELLED,
    Cancellable,
    Cancelled,
    OnEngine,
    Outcome,
    Quiesce,
    StagingBuffers,
)
from cells.migration.messages import (
    KV_DTYPES,
    Abort,
    Final,
    Hello,
    Ready,
    Reservation,
    Verdict,
    receive,
    receive_round,
    send,
)
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.store import StoreAddress, connect
from scheduler.contract.config.scheduler import MigrationConfig
from scheduler.contract.failpoints import failpoint
from scheduler.contract.protocol import CommitRequest, MigrateInCmd, Tail, TokenRecords

log = logging.getLogger("cellflip.migration")


class MigrationReceiver(Cancellable):
    """Destination side of one migration."""

    def __init__(self, cmd: MigrateInCmd, *, cell_id: str, incarnation: str, client: SchedulerClient,
                 cfg: MigrationConfig, on_engine: OnEngine, on_commit: Callable[[str, int, int], None],
                 quiesce: Quiesce = contextlib.nullcontext, staging: StagingBuffers | None = None):
        super().__init__()
        self.cmd, self.cell_id, self.incarnation = cmd, cell_id, incarnation
        self.client, self.cfg, self.on_engine, self.on_commit = client, cfg, on_engine, on_commit
        self.quiesce = quiesce
        self.staging = staging or StagingBuffers(keep=0)
        self.bytes = 0
        self.marks: dict[str, float] = {}
        self.sends: list[list] = []  # [wall instant the bytes were all here, bytes] per KV message
        self._reserved = False

    def run(self) -> Outcome:
        t0 = time.perf_counter()
        out = self._run()
        out.total_s, out.marks, out.sends = time.perf_counter() - t0, self.marks, self.sends
        return out

    def _run(self) -> Outcome:
        rid, mid = self.cmd.request_id, self.cmd.migration_id
        ch = None
        try:
            ch = self._join()
            if not self._reserve(ch, rid):
                return Outcome(rid, mid, "destination", "refused", reason="no room")
            snap = self._receive(ch, rid)
            self.check_cancel()
            failpoint("migrate.before_commit")
            num_generated = snap.num_tokens - snap.prompt_len
            tail = Tail(start=snap.records_from, records=TokenRecords.of(snap.records).packed())
            epoch = self._commit(mid, CommitRequest(self.cell_id, self.incarnation, rid, self.cmd.epoch,
                                                    num_generated, tail, path="kv"))
        except (Refused, Cancelled) as e:
            reason = e.reason if isinstance(e, Refused) else CANCELLED
            self._fail(ch, rid, reason)
            return Outcome(rid, mid, "destination", "aborted", bytes=self.bytes, reason=reason)
        except Exception as e:
            log.warning("migration %s of %s failed at the destination: %s", mid, rid, e)
            self._fail(ch, rid, str(e)[:200])
            return Outcome(rid, mid, "destination", "failed", bytes=self.bytes, reason=str(e)[:200])
        return self._resume(ch, rid, mid, epoch, num_generated)

    def _join(self) -> PairChannel:
        cmd, timeout_s = self.cmd, self.cfg.transfer_timeout_s
        store = connect(StoreAddress(cmd.src_address.split(":")[0], cmd.src_store_port), timeout_s=timeout_s)
        return PairChannel(store, f"mig/{cmd.migration_id}", 1, timeout_s=timeout_s, connect_timeout_s=timeout_s)

    def _reserve(self, ch: PairChannel, rid: str) -> bool:
        hello = receive(ch, Hello)
        self.check_cancel()
        self._reserved = bool(self.on_engine(lambda e: e.reserve(rid, hello.num_tokens, self.cfg.headroom_blocks)))
        send(ch, Reservation(self._reserved))
        return self._reserved

    def _receive(self, ch: PairChannel, rid: str) -> RequestSnapshot:
        """Import copy rounds until the final message; install the request, paused (nothing
        decodes it before the commit). Returns its snapshot with every token id."""
        ids: list[int] = []
        while True:
            msg = receive_round(ch)
            if isinstance(msg, Abort):
                raise TransferError("source aborted the migration")
            final = isinstance(msg, Final)
            if not final:  # the source waits for "ready": answer "aborted" instead
                self.check_cancel()
            failpoint("migrate.transfer")
            if msg.token_ids_from != len(ids):
                raise TransferError(f"token ids out of order: {msg.token_ids_from} != {len(ids)}")
            ids.extend(msg.token_ids)
            data, backing = self.staging.take(msg.shape, KV_DTYPES[msg.dtype])
            if data.numel():
                self._receive_kv(ch, data, final=final)
            if isinstance(msg, Final):
                break
            self.on_engine(lambda e, m=msg, d=data: e.import_kv(rid, m.start, d))
            self.staging.give(backing)  # import_kv copied it into the pool
        self.marks["final_received"] = time.time()
        self.check_cancel()
        snap = msg.snapshot
        snap.token_ids, snap.token_ids_from = ids, 0

        def install(e, start=msg.start, d=data):
            if d.numel():
                e.import_kv(rid, start, d)
            e.import_request(snap)

        self.on_engine(install)
        self.staging.give(backing)
        self.marks["imported"] = time.time()
        return snap

    def _receive_kv(self, ch: PairChannel, data: torch.Tensor, final: bool) -> None:
        if final:
            ch.recv_tensor(data)
        else:  # a copy round: post the receive, then tell the sender to go
            with self.quiesce():
                pending = ch.irecv(data)
                send(ch, Ready(True))
                pending.wait()
        nbytes = data.numel() * data.element_size()
        self.sends.append([time.time(), nbytes])
        self.bytes += nbytes

    def _resume(self, ch: PairChannel, rid: str, mid: str, epoch: int, num_generated: int) -> Outcome:
        """Committed: this cell owns the request at `epoch`. Resume, then tell the source to free."""
        try:
            self.marks["committed"] = time.time()
            failpoint("migrate.after_commit")
            self.on_engine(lambda e: (self.on_commit(rid, epoch, num_generated), e.resume_request(rid)))
            self.marks["resumed"] = time.time()
            self._tell(ch, Verdict(committed=epoch))
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

    def _fail(self, ch: PairChannel | None, rid: str, reason: str) -> None:
        """Before the commit: free the reservation and tell the source (best effort)."""
        if self._reserved:
            self.on_engine(lambda e: e.release(rid))
        if ch is not None:
            self._tell(ch, Verdict(aborted=reason))
            ch.close()

    @staticmethod
    def _tell(ch: PairChannel, verdict: Verdict) -> None:
        try:
            send(ch, verdict)
        except TransferError:
            pass  # the source decides through the scheduler, not through us

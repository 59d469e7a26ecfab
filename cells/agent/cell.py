"""The cell agent: one process per cell.

Registers with the scheduler under a fresh incarnation, renews its lease with every sync, runs
the engine loop, and executes the scheduler's commands. Two loops share one engine lock:

    engine loop:  collect(engine.step())                  # decode back to back
    sync loop:    commands = sync(tokens, summary)        # tokens reach the store before any
                  handle(commands)                        # client sees them; start / migrate /
                                                          # abort / suspend / set_role
Decoding never waits for the network, and the network never waits for a step. Commands go
through a type → handler table (commands.py); migration threads (moves.py) run their engine
operations (export, pause, import, resume) under the same engine lock as the step, so they
wait for at most one step, never for a whole tick.

A fenced agent (lease lost, or a newer incarnation of its cell id) drops every request and
registers again as a new incarnation: it never resumes the old one's work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid

from cells.agent.commands import Commands
from cells.agent.held import HeldContexts
from cells.agent.moves import Moves
from cells.agent.owned import Owned, log_accepted
from cells.client import Fenced, Refused, SchedulerClient
from cells.engine.base import Engine, kv_handover, scoring, versioned_weights
from cells.roles import CellRole
from cells.training.worker import TrainingWorker
from cells.transport.store import StoreHost
from cells.versions import CellVersions
from scheduler.contract.config import CellflipConfig
from scheduler.contract.config.engine import served_model
from scheduler.contract.gcpolicy import GcPolicy, log_long_pauses
from scheduler.contract.probe import probe_tokens
from scheduler.contract.protocol import (
    AnyEvent,
    RegisterRequest,
    SyncRequest,
    TokenBatch,
    TokenRecords,
)

log = logging.getLogger("cellflip.cell")

IDLE_WAIT_S = 0.25
"""Long-poll of an idle cell's sync: commands arrive at once, an idle cell costs nothing."""
HANDOFF_S = 0.002
"""After a step with new tokens, the engine loop waits at most this long for a sleeping sync
loop to collect them, so that they do not wait out the next step behind the engine lock."""
STEP_WAIT_S = 0.5
"""Longest a copy message waits for the engine to run one step after the previous pause
(`quiesce`)."""
STALL_LOG_S = 10.0
"""An engine with work that produced no token for this long logs the cell's state (once a minute)."""
REGISTER_RETRY_S = 120.0
"""How long a new incarnation retries while the previous one's lease on its id runs out."""


class CellAgent:
    """One cell's agent: owns the engine (behind the engine lock), the requests it owns, the
    events to report, and the parts that act on them: `commands` (the scheduler's commands),
    `moves` (migration threads), `versions` (weight versions and scoring), `training` (the
    training rank)."""

    def __init__(self, cfg: CellflipConfig, *, cell_id: str, scheduler_url: str, engine: Engine,
                 host: str = "127.0.0.1", token: str | None = None, job: str | None = None):
        self.cfg, self.cell_id, self.host, self.engine = cfg, cell_id, host, engine
        self.job = job
        """The RL job to register into (`--job`); sent once: a re-registration keeps its recorded job."""
        self.client = SchedulerClient(scheduler_url, token)
        self.store_host = StoreHost(host, 0)
        self.incarnation = ""
        self.role = CellRole()
        self.owned: dict[str, Owned] = {}
        self.held = HeldContexts()
        """The sessions' contexts held here: what a sticky turn's delta start builds on."""
        self.events: list[AnyEvent] = []
        self._engine_lock = threading.RLock()
        self._num_waiting = 0  # threads other than the engine loop waiting for the lock
        self._waiting_lock = threading.Lock()
        self._cv = threading.Condition()
        self._quiet = 0  # copy rounds on the wire that asked decoding to pause (quiesce)
        self._quiet_until = 0.0
        self._steps = 0  # engine steps run by the engine loop
        self._steps_at_release = -1  # `_steps` when the last quiesce ended
        caps = engine.capabilities
        on_host = caps.kv_export and kv_handover(engine).kv_on_host()  # an engine without KV export: its own
        mode = cfg.migration.copy_quiesce
        self._quiesce_s = cfg.migration.copy_quiesce_max_ms / 1e3 if mode == "on" or (mode == "auto" and on_host) else 0.0
        self.heartbeat_s = cfg.scheduler.heartbeat_s
        self.num_ticks = 0
        self._sync_parked = False  # the sync loop sleeps on the condition, waiting for tokens
        self._sync_collects = 0  # batches the sync loop has collected so far
        self._progress_at = time.monotonic()  # the engine last produced a token, or had no work
        self._stall_logged_at = float("-inf")
        keep = cfg.cells.keep_training_memory == "auto" and not caps.role_handover
        self.training = TrainingWorker(cell_id, device=engine.train_device, keep_memory=keep,
                                       local_loss=cfg.trainer.objective.get("loss"), cell_size=cfg.cells.train_ranks)
        """The cell's training rank: takes the trainer's step assignments in the training role."""
        prepare = versioned_weights(engine).prepare_weights if caps.versioned_weights else None
        self.versions = CellVersions(cell_id, emit=self.events_append, wake=self.wake,
                                     timeout_s=cfg.migration.transfer_timeout_s, prepare=prepare, engine=engine,
                                     local=self.training.weights_for)
        self.moves = Moves(self, on_host=on_host)
        """The cell's migration threads (migrate_out / migrate_in / cancel_migration)."""
        self.commands = Commands(self)
        """The scheduler's commands, by type."""
        self.gc_policy: GcPolicy | None = None
        """Set by `manage_gc` where the cell owns its process."""

    def events_append(self, event: AnyEvent) -> None:
        """Queue an event for the next sync (any thread)."""
        self.events.append(event)
        self.wake()

    # -- lifecycle --------------------------------------------------------------------------
    def register(self) -> None:
        """Register as a new incarnation. While the previous process's lease has not lapsed the
        scheduler refuses the id (`cell_id_in_use`): retried until it has (bounded)."""
        self.incarnation = uuid.uuid4().hex
        summary = self.engine.summary()
        req = RegisterRequest(
            cell_id=self.cell_id, incarnation=self.incarnation, address=f"{self.host}:0",
            store_port=self.store_host.address.port, capabilities=self.engine.capabilities,
            kv_blocks_total=summary.kv_blocks_total, max_running=summary.max_running,
            version=summary.version, probe=probe_answer(self.engine, summary.version),
            model=served_model(self.cfg.cells.engine), job=self.job)
        deadline = time.monotonic() + REGISTER_RETRY_S
        while True:
            try:
                resp = self.client.register(req)
                break
            except Refused as e:
                if e.reason != "cell_id_in_use" or time.monotonic() > deadline:
                    raise
                log.info("cell %s: the id is still leased to the previous incarnation; retrying", self.cell_id)
                time.sleep(0.5)
        self.heartbeat_s = resp.heartbeat_s
        self.job = None  # registered into it: later registrations keep what the scheduler records
        self.role.set("rollout", f"registered at generation {resp.generation}")
        log.info("cell %s registered as %s", self.cell_id, self.incarnation[:8])

    def run(self, stop: threading.Event) -> None:
        """Register, then run the engine loop on a thread and the sync loop here until `stop`."""
        self.register()
        engine_thread = threading.Thread(target=self._engine_loop, args=(stop,), name="engine", daemon=True)
        engine_thread.start()
        self.training.start()
        try:
            self._sync_loop(stop)
        finally:
            stop.set()
            self.training.close()
            self.wake()
            engine_thread.join(timeout=30)
            self.client.close()
            self.versions.close()

    @contextlib.contextmanager
    def access(self):
        """The engine lock for threads other than the engine loop, which yields to them
        between steps (Python locks are not fair)."""
        with self._waiting_lock:
            self._num_waiting += 1
        try:
            with self._engine_lock:
                yield
        finally:
            with self._waiting_lock:
                self._num_waiting -= 1

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _engine_loop(self, stop: threading.Event) -> None:
        """Decode back to back while there is work; the sync loop ships the tokens."""
        while not stop.is_set():
            while self._num_waiting and not stop.is_set():
                time.sleep(0.0002)  # hand the lock over: a bare release/re-acquire starves waiters
            with self._engine_lock:
                self.moves.reap()
                if self.versions.has_staged():  # a verified version: install it between steps
                    self.versions.activate_staged(self.engine)
                busy = self.role.state == "rollout" and self.engine.has_work()
                quiet = busy and self._quieted()
                events = self.engine.step() if busy and not quiet else []
                if busy and not quiet:
                    self._steps += 1
                self._collect(events)
            handoff = None
            with self._cv:
                if quiet:  # re-checked under the condition: the copy's end is never missed
                    if self._quieted():
                        self._cv.wait(timeout=self._quiet_until - time.monotonic())
                elif busy:
                    if events and self._sync_parked:
                        handoff = self._sync_collects
                    self._cv.notify_all()  # tokens to ship
                else:
                    self._cv.wait(timeout=IDLE_WAIT_S)
            if handoff is not None:  # the sleeping sync loop takes them before the next step
                deadline = time.monotonic() + HANDOFF_S
                while self._sync_collects == handoff and time.monotonic() < deadline and not stop.is_set():
                    time.sleep(0.00005)
            self.num_ticks += 1

    def _quieted(self) -> bool:
        return bool(self._quiet) and time.monotonic() < self._quiet_until

    @contextlib.contextmanager
    def quiesce(self):
        """Decoding pauses while the block runs, at most `copy_quiesce_max_ms` (a copy round
        on the wire: on CPU cells it shares the cores with the decode loop). Between two pauses
        the engine runs one step (waited for at most STEP_WAIT_S), so a copy round of many
        messages stalls a stream by one message per token, never by the whole round."""
        if not self._quiesce_s:
            yield
            return
        with self._cv:
            if not self._quiet and self._steps == self._steps_at_release:  # no step since the last pause
                self._cv.wait_for(lambda: self._steps != self._steps_at_release or not self._decoding(),
                                  timeout=max(self._quiesce_s, STEP_WAIT_S))
            self._quiet += 1
            self._quiet_until = time.monotonic() + self._quiesce_s
        try:
            with self.access():
                pass  # a decode step in flight ends first; the loop starts no other
            yield
        finally:
            with self._cv:
                self._quiet -= 1
                if not self._quiet:
                    self._steps_at_release = self._steps
                self._cv.notify_all()

    def _decoding(self) -> bool:
        """The engine loop would step now (read without the lock: a hint for `quiesce`)."""
        return self.role.state == "rollout" and self.engine.has_work()

    def manage_gc(self) -> None:
        """This cell owns its process: pace its garbage collection from the sync loop
        (scheduler/contract/gcpolicy.py): what is alive is frozen every second, and the full
        collection (~140 ms of every thread at the small test model) runs every 5 minutes when
        no request is in flight (at most 30 minutes late), not mid-stream."""
        self.gc_policy = GcPolicy(time.monotonic, freeze_every_s=1.0, full_every_s=300.0, max_defer_s=1800.0)
        log_long_pauses(log)

    def _sync_loop(self, stop: threading.Event) -> None:
        """Ship tokens and events as soon as there are any; otherwise renew the lease every
        half heartbeat, or long-poll for commands when the cell has nothing to do."""
        while not stop.is_set():
            if self.gc_policy is not None:
                self.gc_policy.step(idle=not self.owned)
            with self._cv:
                if not self._has_outgoing():
                    if self._is_idle():
                        wait_s = IDLE_WAIT_S
                    else:
                        self._sync_parked = True
                        self._cv.wait(timeout=self.heartbeat_s / 2)
                        self._sync_parked = False
                        wait_s = 0.0
                else:
                    wait_s = 0.0
            try:
                self._sync(wait_s)
            except Fenced as e:
                with self.access():
                    log.warning("cell %s fenced (%s): dropping %d requests, registering anew",
                                self.cell_id, e, len(self.owned))
                    self.drop_all()
                    self.role.set("down", f"fenced: {e}"[:200])
                    self.register()

    def _has_outgoing(self) -> bool:
        # Read without the engine lock: snapshot the values in one C-level call, since the
        # engine loop and migration threads may add or remove entries meanwhile.
        owned = list(self.owned.values())
        return bool(self.events) or any((o.pending or o.finish_reason) and not o.migrating for o in owned)

    def _is_idle(self) -> bool:
        return not self.engine.has_work() and not self.moves.busy()

    # -- sync -------------------------------------------------------------------------------
    def _sync(self, wait_s: float):
        batches, sent = [], []
        with self.access():
            for rid, o in self.owned.items():
                if o.migrating or not (o.pending or o.finish_reason):
                    continue
                batches.append(TokenBatch(rid, o.epoch, o.flushed, TokenRecords.of(o.pending).packed(),
                                          o.finish_reason))
                sent.append((rid, len(o.pending)))
            events, self.events = self.events, []
            summary = self.engine.summary()
            self._sync_collects += 1
        summary = dataclasses.replace(summary, role=self.role.ready_role(), loading=sorted(self.versions.loading))
        req = SyncRequest(self.incarnation, summary, batches, events, wait_s)
        sent_at = time.time()
        try:
            resp = self.client.sync(self.cell_id, req)
        except Fenced:
            raise
        except Exception as e:  # scheduler unreachable: keep everything, retry shortly
            log.warning("sync failed: %s", e)
            with self.access():
                self.events = events + self.events
            time.sleep(min(self.heartbeat_s, 0.5))
            return
        rejected = set(resp.rejected)
        log_accepted(self.cell_id, sent_at, batches, rejected)
        with self.access():
            for rid, n in sent:
                o = self.owned.get(rid)
                if o is None or rid in rejected:
                    continue
                del o.pending[:n]
                o.flushed += n
                if o.finish_reason and not o.pending:
                    del self.owned[rid]
            for rid in resp.rejected:
                self.forget(rid, abort_engine=not self.owned.get(rid, Owned(0, 0)).migrating)
            for cmd in resp.commands:
                self.commands.handle(cmd)
        if resp.commands:
            self.wake()
        self._check_progress()

    def _check_progress(self) -> None:
        """Log the cell's state when its engine holds work but produced nothing for a while (a
        request this cell reports but does not decode: the scheduler's stall watchdog will
        take it back; this says why it stalled here)."""
        now = time.monotonic()
        if not self.engine.has_work():
            self._progress_at = now
        elif now - self._progress_at > STALL_LOG_S and now - self._stall_logged_at > 60.0:
            self._stall_logged_at = now
            log.warning("cell %s: no token for %.0fs with work in the engine: %s", self.cell_id,
                        now - self._progress_at, self.dump_state())

    def dump_state(self) -> str:
        """The agent's and engine's state as one JSON line (stall reports, SIGUSR1). Reads
        without the engine lock: a wedged lock must not hide the state."""
        owned = {rid: {"epoch": o.epoch, "flushed": o.flushed, "pending": len(o.pending), "finish": o.finish_reason,
                       "migrating": o.migrating, "parked": o.parked} for rid, o in list(self.owned.items())}
        try:
            engine = self.engine.debug_state()
        except Exception as e:  # racing the engine loop: say so rather than fail the dump
            engine = {"error": repr(e)}
        return json.dumps({
            "role": self.role.state, "role_history": [list(h) for h in self.role.history[-4:]],
            "owned": owned, "engine": engine, "threads": self.moves.thread_names(),
            "lock_waiters": self._num_waiting, "quiet": self._quiet, "events_queued": len(self.events),
            "versions_loading": sorted(self.versions.loading)}, default=str)

    def _collect(self, events) -> None:
        if events:
            self._progress_at = time.monotonic()
        for ev in events:
            o = self.owned.get(ev.request_id)
            if o is None:
                continue
            o.pending.append(ev.record)
            self.held.sampled(ev.request_id, ev.record.token_id)
            if ev.finish_reason:
                o.finish_reason = ev.finish_reason

    # -- ownership --------------------------------------------------------------------------
    def forget(self, rid: str, abort_engine: bool) -> None:
        """Stop owning `rid` (and drop it from the engine with `abort_engine`)."""
        self.owned.pop(rid, None)
        self.held.ended(rid)
        if abort_engine:
            self.engine.abort(rid)

    def drop_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.owned.clear()
        self.held = HeldContexts()


def probe_answer(engine: Engine, version: int | None) -> list[float] | None:
    """The registration probe's log-probs for the served version (scheduler/contract/probe.py),
    by the engine's scoring path; None where the engine cannot score or its vocabulary is unknown."""
    caps = engine.capabilities
    if not caps.scoring or not caps.vocab_size:
        return None
    tokens = probe_tokens(version, caps.vocab_size, caps.output_ranges)
    return [float(x) for x in scoring(engine).score(tokens, temperature=1.0)]


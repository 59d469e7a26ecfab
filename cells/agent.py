"""The cell agent: one process per cell.

Registers with the scheduler under a fresh incarnation, renews its lease with every sync, runs
the engine loop, and executes the scheduler's commands. Two loops share one engine lock:

    engine loop:  collect(engine.step())                  # decode back to back
    sync loop:    commands = sync(tokens, summary)        # tokens reach the store before any
                  handle(commands)                        # client sees them; start / migrate /
                                                          # abort / suspend / set_role
Decoding never waits for the network, and the network never waits for a step.
Migration threads run their engine operations (export, pause, import, resume) under the same
engine lock as the step, so they wait for at most one step, never for a whole tick.

A fenced agent (lease lost, or a newer incarnation of its cell id) drops every request and
registers again as a new incarnation: it never resumes the old one's work.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from cells.client import Fenced, SchedulerClient
from cells.engine.records import EngineError, SamplingParams
from cells.migration import (
    CHUNK_BYTES,
    MigrationReceiver,
    MigrationSender,
    Outcome,
    StagingBuffers,
    migration_event,
)
from cells.roles import CellRole
from cells.training.worker import TrainingWorker
from cells.transport.store import StoreAddress, StoreHost
from cells.versions import CellVersions
from scheduler.config import CellflipConfig
from scheduler.protocol import (
    AbortCmd,
    CancelMigrationCmd,
    Capabilities,
    DropVersionCmd,
    LoadVersionCmd,
    MigrateInCmd,
    MigrateOutCmd,
    RegisterRequest,
    RoleFailedEvent,
    ScoreCmd,
    SetRoleCmd,
    StartCmd,
    Summary,
    SuspendCmd,
    SyncRequest,
    TokenBatch,
    decode_command,
)

log = logging.getLogger("cellflip.cell")

IDLE_WAIT_S = 0.25
"""Long-poll of an idle cell's sync: commands arrive at once, an idle cell costs nothing."""
HANDOFF_S = 0.002
"""After a step with new tokens, the engine loop waits at most this long for a sleeping sync
loop to collect them, so that they do not wait out the next step behind the engine lock."""
STALL_LOG_S = 10.0
"""An engine with work that produced no token for this long logs the cell's state (once a minute)."""


@dataclass
class Owned:
    """A request this cell owns at `epoch`: generated tokens [flushed, flushed+len(pending))
    are not yet in the store."""

    epoch: int
    flushed: int
    pending: list[list] = field(default_factory=list)
    finish_reason: str | None = None
    migrating: bool = False
    parked: bool = False
    """Suspended with its KV in host memory: it stays ours until it moves out."""


class CellAgent:
    def __init__(self, cfg: CellflipConfig, *, cell_id: str, scheduler_url: str, engine,
                 host: str = "127.0.0.1", token: str | None = None):
        self.cfg, self.cell_id, self.host, self.engine = cfg, cell_id, host, engine
        self.client = SchedulerClient(scheduler_url, token)
        self.store_host = StoreHost(host, 0)
        self.incarnation = ""
        self.role = CellRole()
        self.owned: dict[str, Owned] = {}
        self.events: list[dict] = []
        self._engine_lock = threading.RLock()
        self._num_waiting = 0  # threads other than the engine loop waiting for the lock
        self._waiting_lock = threading.Lock()
        self._cv = threading.Condition()
        self._quiet = 0  # copy rounds on the wire that asked decoding to pause (_quiesce)
        self._quiet_until = 0.0
        pool_k = getattr(getattr(engine, "pool", None), "k", None)
        on_host = pool_k is not None and pool_k.device.type == "cpu"  # an engine without a pool: its own
        mode = cfg.migration.copy_quiesce
        self._quiesce_s = cfg.migration.copy_quiesce_max_ms / 1e3 if mode == "on" or (mode == "auto" and on_host) else 0.0
        # one copy round's worth of warm receive buffer (no bigger than the KV pool itself)
        pool_bytes = pool_k.numel() * pool_k.element_size() * 2 if on_host else 0
        self.staging = StagingBuffers(prealloc_numel=min(CHUNK_BYTES, pool_bytes) // 4)
        self.heartbeat_s = cfg.scheduler.heartbeat_s
        self._outcomes: queue.Queue[Outcome] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.num_ticks = 0
        self._sync_parked = False  # the sync loop sleeps on the condition, waiting for tokens
        self._sync_collects = 0  # batches the sync loop has collected so far
        self._progress_at = time.monotonic()  # the engine last produced a token, or had no work
        self._stall_logged_at = float("-inf")
        self._add_request_kwargs = set(inspect.signature(engine.add_request).parameters)
        self.training = TrainingWorker(cell_id, device=getattr(engine, "train_device", "cpu"))
        """The cell's training rank: takes the trainer's step assignments in the training role."""
        self.versions = CellVersions(cell_id, emit=self.events_append, wake=self._wake,
                                     timeout_s=cfg.migration.transfer_timeout_s,
                                     prepare=getattr(engine, "prepare_weights", None), engine=engine,
                                     local=self.training.weights_for)

    def events_append(self, event: dict) -> None:
        """Queue an event for the next sync (any thread)."""
        self.events.append(event)
        self._wake()

    # -- lifecycle --------------------------------------------------------------------------
    def register(self) -> None:
        self.incarnation = uuid.uuid4().hex
        summary = self.engine.summary()
        resp = self.client.register(RegisterRequest(
            cell_id=self.cell_id, incarnation=self.incarnation, address=f"{self.host}:0",
            store_port=self.store_host.address.port, capabilities=engine_capabilities(self.engine, summary),
            kv_blocks_total=summary["kv_blocks_total"], max_running=summary.get("max_running", 1),
            version=summary["version"]))
        self.heartbeat_s = resp.heartbeat_s
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
            self._wake()
            engine_thread.join(timeout=30)
            self.client.close()
            self.versions.close()

    @contextlib.contextmanager
    def _access(self):
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

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _engine_loop(self, stop: threading.Event) -> None:
        """Decode back to back while there is work; the sync loop ships the tokens."""
        while not stop.is_set():
            while self._num_waiting and not stop.is_set():
                time.sleep(0.0002)  # hand the lock over: a bare release/re-acquire starves waiters
            with self._engine_lock:
                self._reap_outcomes()
                if self.versions.has_staged():  # a verified version: install it between steps
                    self.versions.activate_staged(self.engine)
                busy = self.role.state == "rollout" and self.engine.has_work()
                quiet = busy and self._quieted()
                events = self.engine.step() if busy and not quiet else []
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
    def _quiesce(self):
        """Decoding pauses while the block runs, at most `copy_quiesce_max_ms` (a copy round
        on the wire: on CPU cells it shares the cores with the decode loop)."""
        if not self._quiesce_s:
            yield
            return
        with self._cv:
            self._quiet += 1
            self._quiet_until = time.monotonic() + self._quiesce_s
        try:
            with self._access():
                pass  # a decode step in flight ends first; the loop starts no other
            yield
        finally:
            with self._cv:
                self._quiet -= 1
                self._cv.notify_all()

    def _sync_loop(self, stop: threading.Event) -> None:
        """Ship tokens and events as soon as there are any; otherwise renew the lease every
        half heartbeat, or long-poll for commands when the cell has nothing to do."""
        while not stop.is_set():
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
                with self._access():
                    log.warning("cell %s fenced (%s): dropping %d requests, registering anew",
                                self.cell_id, e, len(self.owned))
                    self._drop_all()
                    self.register()

    def _has_outgoing(self) -> bool:
        # Read without the engine lock: snapshot the values in one C-level call, since the
        # engine loop and migration threads may add or remove entries meanwhile.
        owned = list(self.owned.values())
        return bool(self.events) or any((o.pending or o.finish_reason) and not o.migrating for o in owned)

    def _is_idle(self) -> bool:
        return not self.engine.has_work() and not self._threads

    # -- sync -------------------------------------------------------------------------------
    def _sync(self, wait_s: float):
        batches, sent = [], []
        with self._access():
            for rid, o in self.owned.items():
                if o.migrating or not (o.pending or o.finish_reason):
                    continue
                batches.append(TokenBatch(rid, o.epoch, o.flushed, [tuple(r) for r in o.pending], o.finish_reason))
                sent.append((rid, len(o.pending)))
            events, self.events = self.events, []
            summary = self.engine.summary()
            self._sync_collects += 1
        req = SyncRequest(self.incarnation, Summary(
            inflight=summary["inflight"], kv_blocks_used=summary["kv_blocks_used"],
            kv_blocks_total=summary["kv_blocks_total"], version=summary["version"],
            request_ids=summary["request_ids"], role=self.role.ready_role(),
            versions_held=summary.get("versions_held", [summary["version"]]),
            loading=sorted(self.versions.loading), parked=summary.get("parked", [])), batches, events, wait_s)
        try:
            resp = self.client.sync(self.cell_id, req)
        except Fenced:
            raise
        except Exception as e:  # scheduler unreachable: keep everything, retry shortly
            log.warning("sync failed: %s", e)
            with self._access():
                self.events = events + self.events
            time.sleep(min(self.heartbeat_s, 0.5))
            return
        with self._access():
            rejected = set(resp.rejected)
            for rid, n in sent:
                o = self.owned.get(rid)
                if o is None or rid in rejected:
                    continue
                del o.pending[:n]
                o.flushed += n
                if o.finish_reason and not o.pending:
                    del self.owned[rid]
            for rid in resp.rejected:
                self._forget(rid, abort_engine=not self.owned.get(rid, Owned(0, 0)).migrating)
            for raw in resp.commands:
                self._handle(decode_command(raw))
        if resp.commands:
            self._wake()
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
        debug = getattr(self.engine, "debug_state", None)
        try:
            engine = debug() if debug is not None else self.engine.summary()
        except Exception as e:  # racing the engine loop: say so rather than fail the dump
            engine = {"error": repr(e)}
        return json.dumps({
            "role": self.role.state, "role_history": [list(h) for h in self.role.history[-4:]],
            "owned": owned, "engine": engine, "threads": [t.name for t in self._threads if t.is_alive()],
            "lock_waiters": self._num_waiting, "quiet": self._quiet, "events_queued": len(self.events),
            "versions_loading": sorted(self.versions.loading)}, default=str)

    def _collect(self, events) -> None:
        if events:
            self._progress_at = time.monotonic()
        for ev in events:
            o = self.owned.get(ev.request_id)
            if o is None:
                continue
            o.pending.append(ev.record.to_list())
            if ev.finish_reason:
                o.finish_reason = ev.finish_reason

    # -- commands ---------------------------------------------------------------------------
    def _handle(self, cmd) -> None:
        if isinstance(cmd, StartCmd):
            try:
                # resume point and KV reuse across the session's turns, where the engine has them
                extra = {"prompt_len": cmd.prompt_len, "cache_key": cmd.session_id, "path": cmd.path}
                extra = {k: v for k, v in extra.items() if k in self._add_request_kwargs}
                self.engine.add_request(cmd.request_id, cmd.token_ids, SamplingParams.from_dict(cmd.params), **extra)
            except EngineError as e:
                log.warning("start %s refused: %s", cmd.request_id, e)
                self.owned[cmd.request_id] = Owned(cmd.epoch, cmd.num_generated, finish_reason=f"error: {e}"[:200])
                return
            self.owned[cmd.request_id] = Owned(cmd.epoch, cmd.num_generated)
        elif isinstance(cmd, MigrateOutCmd):
            if cmd.request_id not in self.owned or cmd.request_id not in self.engine.requests:
                return
            sender = MigrationSender(cmd, cell_id=self.cell_id, incarnation=self.incarnation,
                                     store=self.store_host.store, client=self.client, cfg=self.cfg.migration,
                                     on_engine=self.on_engine, flushed=lambda rid=cmd.request_id: self._stop_flush(rid),
                                     synced=None if self.owned[cmd.request_id].parked  # no stream to settle
                                     else (lambda rid=cmd.request_id: self._synced(rid)),
                                     quiesce=self._quiesce, peek=lambda fn: fn(self.engine))
            self._spawn(sender.run, f"mig-out-{cmd.request_id}")
        elif isinstance(cmd, MigrateInCmd):
            receiver = MigrationReceiver(cmd, cell_id=self.cell_id, incarnation=self.incarnation, client=self.client,
                                         cfg=self.cfg.migration, on_engine=self.on_engine, on_commit=self._adopt,
                                         quiesce=self._quiesce, staging=self.staging)
            self._spawn(receiver.run, f"mig-in-{cmd.request_id}",
                        on_crash=lambda rid=cmd.request_id: self._settle_crashed_import(rid))
        elif isinstance(cmd, SuspendCmd) and cmd.park:
            self._park(cmd.request_id)
        elif isinstance(cmd, (AbortCmd, SuspendCmd)):
            self._forget(cmd.request_id, abort_engine=True)
        elif isinstance(cmd, SetRoleCmd):
            self._set_role(cmd)
        elif isinstance(cmd, CancelMigrationCmd):
            pass  # the migration threads settle it through the scheduler's compare-and-set
        elif isinstance(cmd, LoadVersionCmd):
            self.training.source = StoreAddress.from_dict(cmd.source)  # the trainer's store
            self.versions.load(cmd, self._held(), self.engine.version)
        elif isinstance(cmd, ScoreCmd):
            scorer = getattr(self.engine, "scorer", None)
            self.versions.score(cmd, scorer(cmd.version) if scorer and cmd.version in self._held() else None)
        elif isinstance(cmd, DropVersionCmd):
            if cmd.version != self.engine.version and cmd.version in self._held():
                try:
                    self.engine.drop_version(cmd.version)
                except EngineError as e:  # still needed here; the scheduler asks again later
                    log.warning("version %d not dropped: %s", cmd.version, e)
                    return
                log.info("dropped version %d", cmd.version)

    def _held(self) -> list[int]:
        return list(getattr(self.engine, "versions_held", [self.engine.version]))

    def _set_role(self, cmd: SetRoleCmd) -> None:
        if cmd.role == "training":
            for rid, o in list(self.owned.items()):  # anything else left was suspended by the drain deadline
                if not o.parked:
                    self._forget(rid, abort_engine=True)
            if self._engine_role("training", cmd.flip_id):
                self.role.set("training", f"flip {cmd.flip_id}")
                self.training.enter()  # a rank from the next step boundary
        else:
            if self.role.state == "training":
                self.training.leave()  # at a step boundary: the trainer flips back between steps
                self.role.set("loading", f"flip {cmd.flip_id}")
            if self._engine_role("rollout", cmd.flip_id):
                self.role.set("rollout", f"flip {cmd.flip_id}, version {self.engine.version}")
            elif self.role.state == "loading":
                self.role.set("training", f"flip {cmd.flip_id} failed on the engine")

    def _engine_role(self, role: str, flip_id: str) -> bool:
        """Hand the engine's memory over for `role` where the engine does (`enter_role`:
        SGLang releases its GPU memory to training and takes it back). False, with a
        `role_failed` event that rolls the flip back, when the engine refuses."""
        enter = getattr(self.engine, "enter_role", None)
        if enter is None:
            return True
        try:
            enter(role)
        except EngineError as e:
            log.warning("cell %s cannot take the %s role: %s", self.cell_id, role, e)
            self.events_append(RoleFailedEvent(flip_id, f"{role}: {e}"[:500]).to_dict())
            return False
        return True

    def _park(self, rid: str) -> None:
        """Keep the request's KV in host memory, off the KV pool; its unsynced tokens still
        ship. If the engine cannot park it (finished meanwhile, no KV export), it is dropped
        and the scheduler, no longer seeing it reported, re-prefills it from the store."""
        o = self.owned.get(rid)
        park = getattr(self.engine, "park", None)
        try:
            if o is None or park is None:
                raise EngineError("nothing to park" if o is None else "this engine cannot park KV")
            nbytes = park(rid)
        except EngineError as e:
            if o is not None and o.finish_reason:
                return  # it finished first: the finish ships with its last tokens
            log.warning("park %s failed (%s): dropping it for a re-prefill", rid, e)
            self._forget(rid, abort_engine=True)
            return
        o.parked = True
        log.info("parked %s (%d bytes of KV in host memory)", rid, nbytes)

    def _forget(self, rid: str, abort_engine: bool) -> None:
        self.owned.pop(rid, None)
        if abort_engine:
            self.engine.abort(rid)

    def _drop_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.owned.clear()

    # -- migrations -------------------------------------------------------------------------
    def _spawn(self, fn, name: str, on_crash=None) -> None:
        def body():
            try:
                self._outcomes.put(fn())
            except Exception:  # a bug or an injected fault: never leave the request hanging
                log.exception("%s crashed", name)
                if on_crash is not None:
                    on_crash()
            self._wake()

        t = threading.Thread(target=body, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _settle_crashed_import(self, rid: str) -> None:
        """The destination's migration thread died. After its commit the request is ours
        (adopted): resume it. Before: free the reservation; the source keeps the request
        (its abort wins at the scheduler)."""
        with self._access():
            req = getattr(self.engine, "requests", {}).get(rid)
            if rid in self.owned:
                if req is not None and getattr(req, "status", None) == "paused":
                    self.engine.resume(rid)
                    log.warning("resumed %s after its import thread crashed past the commit", rid)
            else:
                self.engine.release(rid)

    def on_engine(self, fn):
        """Run `fn(engine)` from a migration thread between engine steps; returns its result."""
        with self._access():
            out = fn(self.engine)
        self._wake()
        return out

    def _synced(self, rid: str) -> int:
        """Generated tokens of `rid` already in the store (visible to its client)."""
        o = self.owned.get(rid)
        return o.flushed if o is not None else 0

    def _stop_flush(self, rid: str) -> int:
        """Called on the loop thread at the stop-and-copy: no more token batches for `rid`
        from here (its unsynced records travel in the commit's tail)."""
        o = self.owned[rid]
        o.migrating = True
        return o.flushed

    def _adopt(self, rid: str, epoch: int, num_generated: int) -> None:
        """The destination's commit won: own the request from here (called under the lock)."""
        self.owned[rid] = Owned(epoch, num_generated)

    def _reap_outcomes(self) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        while True:
            try:
                o = self._outcomes.get_nowait()
            except queue.Empty:
                return
            if o.role == "source":
                if o.result == "committed":
                    self.owned.pop(o.request_id, None)
                elif o.request_id in self.owned:
                    self.owned[o.request_id].migrating = False
            if o.role == "destination" or o.result != "committed":
                self.events.append(migration_event(o))
            log_path = os.environ.get("CELLFLIP_MIGRATION_LOG")
            if log_path:  # per-migration records for benchmarks and post-mortems
                with open(log_path, "a") as f:
                    f.write(json.dumps({"cell": self.cell_id, **o.__dict__}) + "\n")


def engine_capabilities(engine, summary: dict) -> Capabilities:
    """What the cell reports at registration, read from the engine's duck-typed surface: its
    `capabilities`, the KV block size (`summary()["block_size"]`), the
    shared KV store it reads and writes (`migration_endpoint.kv_store`; None without one) and
    the ranks it adds to a version's update group (`num_update_ranks`; 0: it takes tensors)."""
    caps = engine.capabilities
    block = summary.get("block_size") or 16
    endpoint = getattr(engine, "migration_endpoint", None)
    return Capabilities(kv_export=caps.kv_export, scoring=caps.scoring, weight_update=caps.weight_update,
                        batch_invariant=caps.batch_invariant, block_size=int(block),
                        kv_store=getattr(endpoint, "kv_store", None),
                        update_ranks=int(getattr(engine, "num_update_ranks", 0) or 0))

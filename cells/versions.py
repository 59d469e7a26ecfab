"""Weight versions and the log-prob service, cell side.

Loading, one line: `load_version` → receive (broadcast, or point-to-point fetch; a failed
broadcast falls back to a fetch) on a low-priority thread, into a warm staging buffer (reused
once the engine no longer holds the version in it) → verified → prepared → staged →
the engine loop activates it between two steps (`inflight_policy`: `keep_kv` continues on
the stale KV, `recompute` re-prefills every running request under the new weights) → a
`broadcast` event. The engine never serves a half-received version: only tensors whose every
bucket matched its CRC32 are staged, and activation is one call under the engine lock.

Cells whose engine receives versions through its own collective (`capabilities.update_ranks`
> 0, SGLang), one line: `load_version` (broadcast) → the loader thread waits (bounded) for
this cell's update-group spec and bucket plan from the trainer → staged → the engine loop,
between two steps, has the engine receive it (`CollectiveUpdate.receive_version`: paused,
updated in place, verified, continued) → reported to the trainer → a `broadcast` event. A failed update
asks the trainer once for a fresh group, then falls back to a point-to-point fetch, which
such an engine installs in place (`engine.load_weights`).

Scoring, one line: `score` task → a low-priority worker thread runs the engine's scoring
primitive (the trainer's forward path, cache-free) with that version's weights, beside
decoding and without the engine lock → a `scored` event with provenance `exact`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cells.engine.base import Engine, collective_update, versioned_weights
from cells.transport.p2p import TransferError
from cells.transport.receive import (
    GROUP_RETRIES,
    UpdateAssignment,
    VersionUnavailable,
    await_update_group,
    fetch_version,
    receive_broadcast,
    report_update,
)
from cells.transport.staging import StagingBuffers
from cells.transport.store import StoreAddress
from scheduler.contract.failpoints import failpoint
from scheduler.contract.protocol import (
    AnyEvent,
    BroadcastEvent,
    LoadVersionCmd,
    ScoreCmd,
    ScoredEvent,
)

log = logging.getLogger("cellflip.versions")

FETCH_ATTEMPTS = 3
SCORING_NICE = 10
"""Scoring runs beside decoding; the OS prefers the decode thread."""
RECEIVE_NICE = 10
"""Receiving a version (the transport's threads, started from the loader thread, inherit it),
checking and preparing it run beside decoding too: where cores are short, decoding comes
first and the version arrives later."""


def lower_priority(nice: int) -> bool:
    """Lowers the calling thread's OS priority to `nice` (threads it starts inherit it); False,
    quietly, where that is not possible (not Linux, or not allowed)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (AttributeError, OSError):
        return False


@dataclass
class Staged:
    version: int
    tensors: object
    """Prepared weights (the engine's `prepare_weights`), or raw tensors where the engine
    cannot prepare ahead."""
    prepared: bool
    activate: bool
    policy: str
    mode: str
    seconds: float
    update: UpdateAssignment | None = None
    """An engine-collective update: the engine receives the version itself when activated
    (`tensors` is None); `cmd` and `t0` let a failure retry or fall back to a fetch."""
    cmd: LoadVersionCmd | None = None
    t0: float = 0.0


def update_ranks(engine: Engine | None) -> int:
    """Ranks `engine` adds to a version's update group (0: it takes tensors, no collective)."""
    return engine.capabilities.update_ranks if engine is not None else 0


def _source(cmd: LoadVersionCmd) -> tuple[StoreAddress, str]:
    return StoreAddress(cmd.source["host"], int(cmd.source["port"])), cmd.source.get("namespace", "versions")


class CellVersions:
    """Owned by the agent. `emit(event)` queues an event for the next sync; `wake()`
    nudges the engine loop to activate a staged version."""

    def __init__(self, cell_id: str, emit: Callable[[AnyEvent], None], wake: Callable[[], None],
                 timeout_s: float = 30.0, prepare: Callable | None = None, *,
                 engine: Engine | None = None, join_timeout_s: float = 60.0,
                 local: Callable[[int], dict | None] | None = None) -> None:
        self.cell_id, self.emit, self.wake, self.timeout_s = cell_id, emit, wake, timeout_s
        self.prepare = prepare
        """The engine's `prepare_weights` (`VersionedWeights`): run on the loader thread, so that
        activation on the engine loop is a swap, not a rebuild of every weight."""
        self.engine = engine
        """The cell's engine, read here only for its capabilities (which path a broadcast
        takes); every engine call happens in `activate_staged`, on the engine loop."""
        self.join_timeout_s = join_timeout_s
        """How long a broadcast waits for the trainer's plan naming this cell."""
        self.local = local
        """The cell's own copy of a version, checksum-verified (a training cell that computed
        the update holds it): None where it has none."""
        self.buffers = StagingBuffers()
        """Warm buffers that received versions land in (`cells/transport/staging.py`)."""
        self.receive_nice = RECEIVE_NICE
        self.loaded_bytes = 0
        """Bytes received for versions (broadcasts and fetches; a local install adds none)."""
        self.loading: set[int] = set()
        self.wanted: int | None = None
        """The version the scheduler last told this cell to serve: activated even where it is
        older than the served one (a cell moved to another RL job serves that job's lineage)."""
        self._staged: list[Staged] = []
        self._lock = threading.Lock()
        # Two workers: background scoring at low OS priority, and the final pass (tokens of a
        # version this cell has switched off) at normal priority, since it holds up a drop.
        self._tasks = {False: queue.Queue(), True: queue.Queue()}
        self._workers: dict[bool, threading.Thread] = {}
        self.pause_s = 0.0
        """Engine-loop time spent activating versions (decoding paused)."""

    # -- loading ----------------------------------------------------------------------------
    def load(self, cmd: LoadVersionCmd, held: list[int], serving: int | None) -> None:
        """Start receiving `cmd.version` unless it is held, being received, or served."""
        with self._lock:
            if cmd.activate:
                self.wanted = cmd.version
            if cmd.version in self.loading:
                return
            if cmd.version == serving or (not cmd.activate and cmd.version in held):
                return
            self.loading.add(cmd.version)
        threading.Thread(target=self._receive, args=(cmd,), name=f"version-{cmd.version}", daemon=True).start()

    def _receive(self, cmd: LoadVersionCmd) -> None:
        lower_priority(self.receive_nice)
        t0 = time.perf_counter()
        own = self.local(cmd.version) if self.local is not None and cmd.activate else None
        if own is not None:  # computed here as a training rank: verified, nothing to fetch
            self._stage(cmd, t0, own, "local", "")
            return
        if cmd.mode == "broadcast" and cmd.activate and update_ranks(self.engine) > 0:
            self._await_group(cmd, 0, t0, self.join_timeout_s)
            return
        address, ns = _source(cmd)
        tensors, mode, why = None, cmd.mode, ""
        try:
            if cmd.mode == "broadcast":
                got = receive_broadcast(address, self.cell_id, cmd.version, timeout_s=self.timeout_s,
                                        join_timeout_s=self.join_timeout_s, namespace=ns, buffers=self.buffers)
                tensors, why = got.tensors, got.error or ""
                if tensors is None:
                    log.warning("version %d: broadcast failed here (%s); catching up point-to-point", cmd.version, why)
                    self.emit(BroadcastEvent(cmd.version, time.perf_counter() - t0, ok=False, reason=why[:500],
                                             mode="broadcast", activate=cmd.activate))
                    mode = "fetch"
            if tensors is None:
                tensors, why = self._fetch(address, ns, cmd.version)
        finally:
            if tensors is None:
                with self._lock:
                    self.loading.discard(cmd.version)
        self._stage(cmd, t0, tensors, mode, why)

    def _stage(self, cmd: LoadVersionCmd, t0: float, tensors: dict | None, mode: str, why: str) -> None:
        """Loader thread: prepare and stage verified tensors for the engine loop, or report
        why there are none."""
        if tensors is not None and mode != "local":
            self.loaded_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if tensors is not None and self.prepare is not None:
            try:
                tensors, prepared = self.prepare(tensors), True
            except Exception as e:  # wrong shapes: keep serving the old version, say so
                tensors, why = None, f"install: {e}"
                with self._lock:
                    self.loading.discard(cmd.version)
        else:
            prepared = False
        seconds = time.perf_counter() - t0
        if tensors is None:
            self.emit(BroadcastEvent(cmd.version, seconds, ok=False, reason=why[:500], mode=mode,
                                     activate=cmd.activate))
            return
        with self._lock:
            self._staged.append(Staged(cmd.version, tensors, prepared, cmd.activate, cmd.inflight_policy, mode,
                                       seconds))
        self.wake()

    # -- engine-collective updates (update_ranks > 0) ----------------------------------------
    def _await_group(self, cmd: LoadVersionCmd, attempt: int, t0: float, wait_s: float) -> None:
        """Loader thread: wait for this cell's part in the update group, then stage it for the
        engine loop; not planned in (or the trainer gone): fall back to a fetch."""
        address, ns = _source(cmd)
        assignment, why = await_update_group(address, self.cell_id, cmd.version, attempt=attempt, wait_s=wait_s,
                                             timeout_s=self.timeout_s, namespace=ns)
        if assignment is None:
            self._group_failed(cmd, t0, why or "not received")
            return
        with self._lock:
            self._staged.append(Staged(cmd.version, None, False, cmd.activate, cmd.inflight_policy, "broadcast",
                                       time.perf_counter() - t0, update=assignment, cmd=cmd, t0=t0))
        self.wake()

    def _group_failed(self, cmd: LoadVersionCmd, t0: float, why: str) -> None:
        """Any thread but the engine loop: the broadcast did not reach this cell; say so and
        catch up point-to-point (installed in place by `activate_staged`)."""
        log.warning("version %d: update group failed here (%s); catching up point-to-point", cmd.version, why)
        self.emit(BroadcastEvent(cmd.version, time.perf_counter() - t0, ok=False, reason=why[:500],
                                 mode="broadcast", activate=cmd.activate))
        address, ns = _source(cmd)
        tensors = None
        try:
            tensors, why = self._fetch(address, ns, cmd.version)
        finally:
            if tensors is None:
                with self._lock:
                    self.loading.discard(cmd.version)
        self._stage(cmd, t0, tensors, "fetch", why)

    def _install_update(self, engine, s: Staged) -> None:
        """Engine loop: the engine receives the staged update through its collective (paused
        meanwhile); the outcome goes to the trainer and the scheduler."""
        a, cmd = s.update, s.cmd
        assert a is not None and cmd is not None
        t0 = time.perf_counter()
        if s.version <= engine.version:  # a newer one arrived meanwhile: do not go back
            self._report(cmd, a, False, f"serving version {engine.version} already")
            with self._lock:
                self.loading.discard(s.version)
            ok = s.version == engine.version
            self.emit(BroadcastEvent(s.version, s.seconds, ok=ok, reason="" if ok else f"serving version {engine.version}",
                                     mode="broadcast", activate=s.activate))
            return
        try:
            collective_update(engine).receive_version(s.version, a.group, list(a.buckets), keep_previous=True)
        except Exception as e:  # the engine says whether it still serves the old version
            pause = time.perf_counter() - t0
            self.pause_s += pause
            log.warning("version %d: update group attempt %d failed: %s", s.version, a.attempt, e)
            threading.Thread(target=self._after_failed_update, args=(s, str(e)), daemon=True,
                             name=f"version-{s.version}-retry").start()
            return
        pause = time.perf_counter() - t0
        self.pause_s += pause
        self._report(cmd, a, True, "")
        with self._lock:
            self.loading.discard(s.version)
        log.info("version %d active in %.2fs (update group, attempt %d), installed in %.3fs",
                 s.version, s.seconds + pause, a.attempt, pause)
        self.emit(BroadcastEvent(s.version, s.seconds + pause, ok=True, mode="broadcast", activate=s.activate,
                                 pause_s=pause))

    def _after_failed_update(self, s: Staged, why: str) -> None:
        """Off the engine loop: ask for a fresh group (at most `GROUP_RETRIES` times), else
        tell the trainer and catch up point-to-point."""
        lower_priority(self.receive_nice)
        a, cmd = s.update, s.cmd
        if a.attempt < GROUP_RETRIES:
            self._await_group(cmd, a.attempt + 1, s.t0, a.retry_within_s)
            return
        address, ns = _source(cmd)
        report_update(address, self.cell_id, a, False, why, timeout_s=self.timeout_s, namespace=ns)
        self._group_failed(cmd, s.t0, why)

    def _report(self, cmd: LoadVersionCmd, a: UpdateAssignment, ok: bool, reason: str) -> None:
        """Tell the trainer from a short thread: its store may be slow or gone, the engine
        loop must not wait for it."""
        address, ns = _source(cmd)
        threading.Thread(target=report_update, args=(address, self.cell_id, a, ok, reason),
                         kwargs={"timeout_s": self.timeout_s, "namespace": ns}, daemon=True,
                         name=f"version-{a.version}-report").start()

    def _fetch(self, address: StoreAddress, ns: str, version: int) -> tuple[dict | None, str]:
        why = ""
        for attempt in range(FETCH_ATTEMPTS):
            try:
                return fetch_version(address, self.cell_id, version, timeout_s=self.timeout_s, namespace=ns,
                                     buffers=self.buffers), ""
            except VersionUnavailable as e:
                return None, f"unavailable: {e}"
            except (TransferError, OSError, RuntimeError) as e:
                why = str(e)
                log.warning("version %d: fetch attempt %d failed: %s", version, attempt + 1, e)
                time.sleep(0.5 * (attempt + 1))
        return None, why

    def activate_staged(self, engine) -> bool:
        """Engine loop, between steps, under the engine lock: install what arrived."""
        with self._lock:
            staged, self._staged = self._staged, []
        for s in staged:
            if s.update is not None:
                self._install_update(engine, s)
                continue
            t0 = time.perf_counter()
            try:
                # never back to an older version, but for the one last asked for (another lineage)
                activate = s.activate and s.version != engine.version and (
                    s.version > engine.version or s.version == self.wanted)
                if s.prepared:
                    if activate or s.version != engine.version:
                        versioned_weights(engine).install_prepared(s.version, s.tensors, activate=activate)
                elif activate:
                    engine.load_weights(s.version, s.tensors, keep_previous=True)
                elif s.version != engine.version:
                    versioned_weights(engine).hold_weights(s.version, s.tensors)
                if activate and s.policy == "recompute":
                    engine.recompute_all()  # engines that update in place restart requests anyway
            except Exception as e:  # a bad version (shapes): keep serving the old one, say so
                log.error("version %d not installed: %s", s.version, e)
                self.emit(BroadcastEvent(s.version, s.seconds, ok=False, reason=f"install: {e}"[:500], mode=s.mode,
                                         activate=s.activate))
                continue
            finally:
                with self._lock:
                    self.loading.discard(s.version)
            pause = time.perf_counter() - t0
            self.pause_s += pause
            log.info("version %d %s in %.2fs (%s), installed in %.3fs", s.version,
                     "active" if s.activate else "held for scoring", s.seconds, s.mode, pause)
            self.emit(BroadcastEvent(s.version, s.seconds, ok=True, mode=s.mode, activate=s.activate,
                                     pause_s=pause))
        return bool(staged)

    def has_staged(self) -> bool:
        return bool(self._staged)

    # -- scoring ----------------------------------------------------------------------------
    def score(self, cmd: ScoreCmd, scorer: Callable | None) -> None:
        """Queue a scoring task (`scorer` from the engine's `Scoring.scorer(version)`, None if
        not held)."""
        if scorer is None:
            log.warning("score task %s: version %d is not held here", cmd.task_id, cmd.version)
            return  # the scheduler hands it to a holder after its timeout
        urgent = bool(cmd.urgent)
        w = self._workers.get(urgent)
        if w is None or not w.is_alive():
            w = self._workers[urgent] = threading.Thread(target=self._score_loop, args=(urgent,),
                                                         name="scoring-final" if urgent else "scoring", daemon=True)
            w.start()
        self._tasks[urgent].put((cmd, scorer))

    def _score_loop(self, urgent: bool) -> None:
        if not urgent:
            lower_priority(SCORING_NICE)  # not Linux, or not allowed: plain priority
        while True:
            item = self._tasks[urgent].get()
            if item is None:
                return
            cmd, scorer = item
            failpoint("logprob.final_pass")  # a scoring task (the final pass is made of these)
            t0 = time.perf_counter()
            try:
                lp = scorer(cmd.token_ids, cmd.temperature)
            except Exception as e:
                log.error("score task %s failed: %s", cmd.task_id, e)
                continue
            # lp[j] is the log-prob of the token at session index context_start + j + 1
            off = cmd.context_start + 1
            values = [float(lp[i - off]) for i in range(cmd.start, cmd.end)]
            self.emit(ScoredEvent(cmd.session_id, cmd.start, values, "exact", version=cmd.version,
                                  task_id=cmd.task_id, seconds=time.perf_counter() - t0))

    def close(self) -> None:
        for q in self._tasks.values():
            q.put(None)

"""Weight versions and the log-prob service, cell side.

Loading, one line: `load_version` → receive (broadcast, or point-to-point fetch; a failed
broadcast falls back to a fetch) on a thread, into fresh staging tensors → verified → staged →
the engine loop activates it between two steps (`inflight_policy`: `keep_kv` continues on
the stale KV, `recompute` re-prefills every running request under the new weights) → a
`broadcast` event. The engine never serves a half-received version: only tensors whose every
bucket matched its CRC32 are staged, and activation is one call under the engine lock.

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

from cells.trainer.versions_host import VersionUnavailable, fetch_version, receive_broadcast
from cells.transport.p2p import TransferError
from cells.transport.store import StoreAddress
from scheduler.failpoints import failpoint
from scheduler.protocol import BroadcastEvent, LoadVersionCmd, ScoreCmd, ScoredEvent

log = logging.getLogger("cellflip.versions")

FETCH_ATTEMPTS = 3
SCORING_NICE = 10
"""Scoring runs beside decoding; the OS prefers the decode thread."""


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


class CellVersions:
    """Owned by the agent. `emit(event_dict)` queues an event for the next sync; `wake()`
    nudges the engine loop to activate a staged version."""

    def __init__(self, cell_id: str, emit: Callable[[dict], None], wake: Callable[[], None],
                 timeout_s: float = 30.0, prepare: Callable | None = None) -> None:
        self.cell_id, self.emit, self.wake, self.timeout_s = cell_id, emit, wake, timeout_s
        self.prepare = prepare
        """The engine's `prepare_weights`: run on the loader thread, so that activation on the
        engine loop is a swap, not a rebuild of every weight."""
        self.loading: set[int] = set()
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
            if cmd.version in self.loading:
                return
            if cmd.version == serving or (not cmd.activate and cmd.version in held):
                return
            self.loading.add(cmd.version)
        threading.Thread(target=self._receive, args=(cmd,), name=f"version-{cmd.version}", daemon=True).start()

    def _receive(self, cmd: LoadVersionCmd) -> None:
        t0 = time.perf_counter()
        address = StoreAddress(cmd.source["host"], int(cmd.source["port"]))
        ns = cmd.source.get("namespace", "versions")
        tensors, mode, why = None, cmd.mode, ""
        try:
            if cmd.mode == "broadcast":
                got = receive_broadcast(address, self.cell_id, cmd.version, timeout_s=self.timeout_s, namespace=ns)
                tensors, why = got.tensors, got.error or ""
                if tensors is None:
                    log.warning("version %d: broadcast failed here (%s); catching up point-to-point", cmd.version, why)
                    self.emit(BroadcastEvent(cmd.version, time.perf_counter() - t0, ok=False, reason=why[:500],
                                             mode="broadcast", activate=cmd.activate).to_dict())
                    mode = "fetch"
            if tensors is None:
                tensors, why = self._fetch(address, ns, cmd.version)
        finally:
            if tensors is None:
                with self._lock:
                    self.loading.discard(cmd.version)
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
                                     activate=cmd.activate).to_dict())
            return
        with self._lock:
            self._staged.append(Staged(cmd.version, tensors, prepared, cmd.activate, cmd.inflight_policy, mode,
                                       seconds))
        self.wake()

    def _fetch(self, address: StoreAddress, ns: str, version: int) -> tuple[dict | None, str]:
        why = ""
        for attempt in range(FETCH_ATTEMPTS):
            try:
                return fetch_version(address, self.cell_id, version, timeout_s=self.timeout_s, namespace=ns), ""
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
            t0 = time.perf_counter()
            try:
                activate = s.activate and s.version > engine.version
                if s.prepared:
                    if activate or s.version != engine.version:
                        engine.install_prepared(s.version, s.tensors, activate=activate)
                elif activate:
                    engine.load_weights(s.version, s.tensors, keep_previous=True)
                elif s.version != engine.version:
                    engine.hold_weights(s.version, s.tensors)
                if activate and s.policy == "recompute":
                    engine.recompute_all()
            except Exception as e:  # a bad version (shapes): keep serving the old one, say so
                log.error("version %d not installed: %s", s.version, e)
                self.emit(BroadcastEvent(s.version, s.seconds, ok=False, reason=f"install: {e}"[:500], mode=s.mode,
                                         activate=s.activate).to_dict())
                continue
            finally:
                with self._lock:
                    self.loading.discard(s.version)
            pause = time.perf_counter() - t0
            self.pause_s += pause
            log.info("version %d %s in %.2fs (%s), installed in %.3fs", s.version,
                     "active" if s.activate else "held for scoring", s.seconds, s.mode, pause)
            self.emit(BroadcastEvent(s.version, s.seconds, ok=True, mode=s.mode, activate=s.activate,
                                     pause_s=pause).to_dict())
        return bool(staged)

    def has_staged(self) -> bool:
        return bool(self._staged)

    # -- scoring ----------------------------------------------------------------------------
    def score(self, cmd: ScoreCmd, scorer: Callable | None) -> None:
        """Queue a scoring task (`scorer` from `engine.scorer(version)`, None if not held)."""
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
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SCORING_NICE)
            except (AttributeError, OSError):
                pass  # not Linux, or not allowed: plain priority
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
                                  task_id=cmd.task_id, seconds=time.perf_counter() - t0).to_dict())

    def close(self) -> None:
        for q in self._tasks.values():
            q.put(None)

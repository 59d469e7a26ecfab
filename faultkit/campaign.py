"""A seeded fault campaign over a real local cluster (scheduler + 3 cells + a trainer-side
version host), with a history of every operation and invariant checks over it.

One run: make the cluster healthy (restart what a previous fault killed, flip cells back to
rollout, every cell on the current version, every token scored) → arm the victim (restart it
with its failpoints) → start streamed completions → trigger (a flip, a publish, a signal) →
the fault fires (observed: a process that died by SIGKILL, one seen stopped, a failpoint's
message in its log, a signal delivered) → react as an operator would (restart the killed
process, SIGCONT the zombie after its lease) → every request ends → check I1–I5 (checker.py).
A store sampler reads the SQLite store (read-only) every `SAMPLE_S` throughout, feeding the
I2/I3 checks and the recovery times: recovery = from the fault until every request unfinished
at the fault commits a token again (or ends); healthy = from the fault until the next run may
start.

Scenarios (SCENARIOS): migration faults at every migration failpoint on the source and the
destination (SIGKILL, raise), a partition inside a KV transfer (`block`), a zombie cell
(SIGSTOP past its lease, SIGCONT), a zombie destination stopped right after its commit, the
scheduler SIGKILLed between recording a flip and acting on it and at every migration failpoint
(then restarted: I5), the trainer SIGKILLed mid-broadcast, a receiver killed or stalled
mid-bucket, and a cell killed or failing during the log-prob scoring pass.

The canary (`canary=True`) restarts the scheduler with the test-only switch
CELLFLIP_CANARY_NO_FENCING=1 (scheduler/contract/failpoints.py) and runs the fencing-sensitive
scenarios again; the checkers must report violations there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cells.localcluster import SMALL_MODEL, Cluster, Streamer
from cells.transport.broadcast import SETTLE_EXTRA_S
from faultkit import checker
from faultkit.history import History
from faultkit.nemesis import Nemesis, version_weights

LEASE_S = 2.0
TRANSFER_TIMEOUT_S = 3.0
SAMPLE_S = 0.1
REQUEST_DEADLINE_S = 90.0
"""Every request of a run must end within this after its fault (else: a hang, and lost)."""
HEALTHY_DEADLINE_S = 60.0
STALL_TIMEOUT_S = 15.0
"""The scheduler's stall watchdog here: well inside the 60 s a run waits for tokens."""
STALL_LOG_LINE = "has not advanced for"
"""What the scheduler logs when its watchdog takes requests back (scheduler/control/ownership.py)."""
BUCKET_BYTES = 256 << 10
CELLS = 3

SRC_FPS = ["migrate.after_copy_round", "migrate.before_stop_copy", "migrate.after_stop_copy",
           "migrate.before_source_free"]
DST_FPS = ["migrate.transfer", "migrate.before_commit", "migrate.after_commit"]
ALL_FPS = ["migrate.after_copy_round", "migrate.before_commit", "migrate.after_stop_copy", "migrate.transfer",
           "migrate.before_stop_copy", "migrate.after_commit", "migrate.before_source_free"]
"""Every migration failpoint, source and destination sides interleaved."""


def campaign_config(tmp: Path) -> dict:
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": LEASE_S, "heartbeat_s": 0.2,
                      "min_rollout_cells": 1, "drain_deadline_s": 10.0, "stall_timeout_s": STALL_TIMEOUT_S},
        "cells": {"count": CELLS, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 512,
                                             "block_size": 8, "batch_invariant": True}},
        "migration": {"transfer_timeout_s": TRANSFER_TIMEOUT_S},
        # load_timeout_s: a restarted cell boots on version 0 and the scheduler re-sends
        # `load_version` to a cell id only this long after the last one (even to a previous
        # incarnation): short, so that restarted cells catch up within a run.
        "versions": {"task_timeout_s": 4.0, "load_timeout_s": 2.0},
    }


class Hang(Exception):
    """A bounded wait of a run ran out: the system did not recover in time."""


# -- the store, read-only --------------------------------------------------------------------
def read_store(conn: sqlite3.Connection, sessions: list[str] | None = None, full: bool = False) -> dict:
    """One consistent snapshot (checker.py's `sample` shape); `sessions`: also their token
    rows [(idx, token_id, loss_mask, version, provenance)]; `full`: with cell histories."""
    conn.execute("BEGIN")
    try:
        s: dict[str, Any] = {}
        s["requests"] = {r[0]: {"cell": r[1], "epoch": r[2], "state": r[3], "n": r[4], "session": r[5],
                                "base": r[6], "reason": r[7]}
                         for r in conn.execute("SELECT id, cell_id, epoch, state, num_generated, session_id, base,"
                                               " reason FROM requests")}
        s["migrations"] = {r[0]: {"request": r[1], "src": r[2], "dst": r[3], "epoch": r[4], "state": r[5],
                                  "path": r[6], "finished_at": r[7], "created_at": r[8], "commit_tokens": r[9]}
                           for r in conn.execute("SELECT id, request_id, src, dst, epoch, state, path, finished_at,"
                                                 " created_at, commit_tokens FROM migrations")}
        s["cells"] = {r[0]: {"state": r[1], "generation": r[2], "incarnation": r[3], "version": r[4],
                             "history": json.loads(r[5]) if full else []}
                      for r in conn.execute("SELECT id, state, generation, incarnation, version, history FROM cells")}
        s["versions"] = dict(conn.execute("SELECT v, state FROM versions").fetchall())
        s["unscored"] = dict(conn.execute("SELECT version, COUNT(*) FROM tokens WHERE loss_mask = 1 AND provenance"
                                          " IS NULL GROUP BY version").fetchall())
        s["flips"] = {r[0]: r[1] for r in conn.execute("SELECT id, state FROM flips")}
        s["foreign_batches"] = [{"request": r[0], "cell": r[1], "epoch": r[2], "owner": r[3], "owner_epoch": r[4],
                                 "start": r[5], "count": r[6], "new": r[7]}
                                for r in conn.execute("SELECT request_id, cell_id, epoch, owner, owner_epoch, start,"
                                                      " count, new FROM foreign_batches ORDER BY at")]
        if full:
            s["flip_rows"] = {r[0]: {"cell": r[1], "to": r[2], "state": r[3], "created_at": r[4]}
                              for r in conn.execute("SELECT id, cell_id, to_role, state, created_at FROM flips")}
        if sessions:
            s["tokens"] = {sid: conn.execute("SELECT idx, token_id, loss_mask, version, provenance FROM tokens"
                                             " WHERE session_id = ? ORDER BY idx", (sid,)).fetchall()
                           for sid in sessions}
            s["token_epochs"] = {sid: conn.execute("SELECT idx, epoch FROM tokens WHERE session_id = ? AND"
                                                   " loss_mask = 1 ORDER BY idx", (sid,)).fetchall()
                                 for sid in sessions}
    finally:
        conn.execute("COMMIT")
    return s


def open_store(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, isolation_level=None,
                           check_same_thread=False)


# -- runs ------------------------------------------------------------------------------------
@dataclass
class Client:
    stream: Streamer
    process: str
    ref: int
    """History index of its invoke."""


@dataclass
class Run:
    scenario: str
    index: int
    seed: int
    canary: bool = False
    params: dict = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    clients: list[Client] = field(default_factory=list)
    flips: list[str] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    t0: float = 0.0
    t_fault: float | None = None
    t_healthy: float | None = None
    violations: list[str] = field(default_factory=list)
    checker_errors: list[str] = field(default_factory=list)
    """A checker that raised: it checked nothing, so the run fails (never a silent pass)."""
    lost: int = 0
    hangs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    recovery_s: float | None = None
    mig_log_offset: int = 0
    exits: list[str] = field(default_factory=list)
    """Processes that died on their own (not by a fault of the nemesis): crashes."""
    stalls: int = 0
    """Requests the scheduler's stall watchdog took back from a cell that held them undecoded."""
    failed: int = 0
    """Accepted requests that ended `failed` (a client sees an error finish)."""
    stream_errors: int = 0
    """Clients whose stream broke and could not be followed again under its Idempotency-Key."""
    reconnects: int = 0
    """Follows after a broken stream (a real client's reconnect; not a loss when it completes)."""
    unfired: int = 0
    """Faults the scenario armed that never fired: the run tested nothing of them."""
    recoveries: list[float] = field(default_factory=list)
    """Per request unfinished at the fault: seconds from the fault to its client's next token
    (or its finish)."""

    def summary(self) -> dict:
        return {"scenario": self.scenario, "index": self.index, "seed": self.seed, "canary": self.canary,
                "params": self.params, "faults": self.faults, "violations": self.violations, "lost": self.lost,
                "hangs": self.hangs, "notes": self.notes, "exits": self.exits, "stalls": self.stalls,
                "checker_errors": self.checker_errors, "failed": self.failed, "stream_errors": self.stream_errors,
                "reconnects": self.reconnects, "unfired": self.unfired, "recoveries": self.recoveries,
                "recovery_s": self.recovery_s,
                "healthy_s": None if self.t_healthy is None or self.t_fault is None else self.t_healthy - self.t_fault,
                "requests": [c.stream.request_id for c in self.clients]}


class Campaign:
    def __init__(self, workdir: Path, seed: int = 0, log: Callable[[str], None] = print) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.log = log
        self.history = History(self.workdir / "history.jsonl")
        self.cfg = campaign_config(self.workdir)
        self.db_path = self.cfg["scheduler"]["db_path"]
        self.mig_log = self.workdir / "migrations.jsonl"
        self.run: Run | None = None
        self.runs: list[Run] = []
        self.checker = checker.SampleChecker()
        self.served: set[tuple[str, int | None]] = set()
        self.complete: set[int] = {0}
        self.partial: set[int] = set()
        self.target = 0
        self.next_version = 1
        self.weights: dict[int, dict] = {}
        self._engines: dict[int, Any] = {}
        self._seen_once: set[str] = set()
        self._exits_seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._n_clients = 0
        saved = os.environ.get("CELLFLIP_MIGRATION_LOG")
        os.environ["CELLFLIP_MIGRATION_LOG"] = str(self.mig_log)  # every cell logs its migrations' ends
        try:
            self.cluster = Cluster(self.workdir / "cluster", num_cells=CELLS, cfg=self.cfg)
        finally:
            if saved is None:
                os.environ.pop("CELLFLIP_MIGRATION_LOG", None)
            else:
                os.environ["CELLFLIP_MIGRATION_LOG"] = saved
        self.nem = Nemesis(self.cluster, self.history)
        from cells.transport.versions_host import VersionHost

        # One bucket per op: a receiver's `broadcast.mid_bucket` fires between two ops.
        self.host = VersionHost(bucket_bytes=BUCKET_BYTES, timeout_s=TRANSFER_TIMEOUT_S,
                                join_timeout_s=TRANSFER_TIMEOUT_S, op_bytes=BUCKET_BYTES)
        self.host.start()
        self.conn = open_store(self.db_path)  # the sampler's
        self._conn2 = open_store(self.db_path)  # everyone else's, under _conn_lock
        self._conn_lock = threading.Lock()
        self.last_broadcast = None
        self.sampler = threading.Thread(target=self._sample_loop, name="sampler", daemon=True)
        self.sampler.start()

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def http(self) -> httpx.Client:
        return self.cluster.http

    def close(self) -> None:
        self._stop.set()
        self.sampler.join(timeout=5)
        self.nem.stop_trainers()
        self.host.close(grace_s=1.0)
        self.cluster.stop()
        self.conn.close()
        self._conn2.close()
        self.history.close()

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            try:
                s = read_store(self.conn)
            except sqlite3.Error:
                time.sleep(SAMPLE_S)
                continue
            s["t"] = time.monotonic()
            try:
                new = self.checker.feed(s)
            except Exception as e:  # counted against the run, like a violation
                new = []
                with self._lock:
                    if self.run is not None:
                        self.run.checker_errors.append(f"sampler: {e!r}")
            with self._lock:
                run = self.run
                for c, cell in s["cells"].items():
                    if cell["state"] != "down":
                        self.served.add((c, cell["version"]))
                if run is not None:
                    ids = {c.stream.request_id for c in run.clients if c.stream.request_id}
                    run.samples.append({"t": s["t"], "requests": {r: s["requests"][r] for r in ids
                                                                  if r in s["requests"]}})
                    for v in new:
                        run.violations.append(v)
                        self.history.info("sampler", "violation", text=v, run=run.index)
            self._stop.wait(SAMPLE_S)

    def snapshot(self, sessions: list[str] | None = None) -> dict:
        with self._conn_lock:
            return read_store(self._conn2, sessions, full=True)

    def wait(self, pred: Callable[[], Any], timeout_s: float, what: str, every: float = 0.05) -> Any:
        try:
            return self.cluster.wait(pred, timeout_s, what, every)
        except TimeoutError as e:
            raise Hang(str(e)) from None

    def fault(self, run: Run, kind: str, target: str, **detail: Any) -> None:
        """Record a fault that demonstrably happened."""
        t = time.monotonic()
        run.faults.append({"kind": kind, "target": target, "t": round(t - run.t0, 3), **detail})
        if run.t_fault is None:
            run.t_fault = t
        self.history.info("nemesis", "fault", kind=kind, target=target, run=run.index, **detail)

    def await_fault(self, run: Run, pred: Callable[[], bool], timeout_s: float, kind: str, target: str,
                    **detail: Any) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                self.fault(run, kind, target, **detail)
                return True
            time.sleep(0.02)
        run.notes.append(f"fault {kind} on {target} {detail} did not fire within {timeout_s:.0f}s")
        run.unfired += 1
        self.history.info("nemesis", "not_fired", kind=kind, target=target, run=run.index, **detail)
        return False

    # -- cluster control --------------------------------------------------------------------
    def cells(self) -> dict[str, dict]:
        """The campaign's own cells (a rogue a scenario registered is not one of them)."""
        ours = {f"cell-{i}" for i in range(CELLS)}
        return {c["id"]: c for c in self.cluster.cells() if c["id"] in ours}

    def post_flip(self, run: Run, cell: str, to: str) -> str | None:
        ref = self.history.invoke("campaign", "flip", cell=cell, to=to)
        try:
            r = self.http.post("/v1/flips", json={"cell": cell, "to": to})
        except httpx.HTTPError as e:
            self.history.fail(ref, repr(e))
            return None
        if r.status_code != 202:
            self.history.fail(ref, f"{r.status_code}: {r.text[:200]}")
            return None
        fid = r.json()["id"]
        run.flips.append(fid)
        self.history.ok(ref, id=fid)
        return fid

    def flips_done(self, ids: list[str], timeout_s: float = 60) -> dict[str, str]:
        states = {}

        def done() -> bool:
            for fid in ids:
                states[fid] = self.http.get(f"/v1/flips/{fid}").json()["state"]
            return all(s in ("done", "failed", "rolled_back") for s in states.values())

        self.wait(done, timeout_s, f"flips {ids}")
        return states

    def flip_all(self, run: Run, moves: list[tuple[str, str]], timeout_s: float = 60) -> None:
        ids = [f for f in (self.post_flip(run, c, to) for c, to in moves) if f]
        states = self.flips_done(ids, timeout_s)
        if any(s != "done" for s in states.values()):
            raise Hang(f"setup flips {moves} ended {states}")

    def restart(self, plan: dict[str, dict[str, str] | None]) -> None:
        """Restart cells (armed with failpoints, or plain) and wait until they serve rollouts
        on the target version (a fresh process boots on version 0 and catches up)."""
        self.nem.restart_cells({int(n.split("-")[1]): fps for n, fps in plan.items()})
        self.wait(lambda: all(self.cluster.cell(n)["version"] == self.target for n in plan), HEALTHY_DEADLINE_S,
                  f"{sorted(plan)} caught up to version {self.target}")

    def healthy(self, run: Run | None) -> None:
        """The state every run starts from: the scheduler up, every cell alive, rollout, on the
        target version, no flip in flight, every token with an old log-prob."""
        nem = self.nem
        if not nem.alive("scheduler") or "scheduler" in nem.armed:
            nem.restart_scheduler()
        dead = {}
        for i in range(CELLS):
            name = f"cell-{i}"
            if nem.stopped(name):
                nem.signal(name, signal.SIGCONT, "heal")
            if not nem.alive(name) or name in nem.armed:
                dead[name] = None  # killed, or still armed: restart plain
        if dead:
            self.restart(dead)

        def flips_idle() -> bool:
            fl = self.http.get("/v1/flips").json()
            fl = fl["flips"] if isinstance(fl, dict) else fl
            return not any(f["state"] in ("pending", "draining", "loading") for f in fl)

        self.wait(flips_idle, HEALTHY_DEADLINE_S, "no flip in flight")
        back = [(c, "rollout") for c, v in self.cells().items() if v["state"] == "training"]
        if back:
            tmp = run or Run("healthy", -1, 0)
            self.flip_all(tmp, back)

        def ready() -> bool:
            cs = self.cells()
            return all(c["state"] == "rollout" and c["version"] == self.target for c in cs.values())

        self.wait(ready, HEALTHY_DEADLINE_S, f"every cell rollout on version {self.target}")

        def scored() -> bool:
            s = self.snapshot()
            return not any(s["unscored"].values()) and not any(
                st == "retiring" for v, st in s["versions"].items() if v < self.target)

        self.wait(scored, HEALTHY_DEADLINE_S, "every token scored, every superseded version retired",
                  every=0.2)

    def hard_reset(self) -> None:
        """After a hang: restart everything (same store)."""
        self.log("  hard reset: restarting the scheduler and every cell")
        self.nem.restart_scheduler()
        self.restart({f"cell-{i}": None for i in range(CELLS)})

    # -- clients ----------------------------------------------------------------------------
    def start_clients(self, run: Run, k: int = 3, min_tokens: int = 3,
                      tokens: tuple[int, int] = (250, 400)) -> list[Client]:
        rng = run.rng
        out = []
        for _ in range(k):
            prompt = [rng.randrange(1024) for _ in range(rng.randrange(30, 80))]
            max_tokens, seed = rng.randrange(*tokens), rng.randrange(1 << 30)
            s = Streamer(self.cluster.url, prompt, max_tokens=max_tokens, seed=seed, timeout_s=REQUEST_DEADLINE_S,
                         token=self.cluster.agent_token, reconnect=True)
            self._n_clients += 1
            name = f"client-{self._n_clients}"
            ref = self.history.invoke(name, "request", prompt=prompt, max_tokens=max_tokens, seed=seed, run=run.index)
            s.start()
            c = Client(s, name, ref)
            run.clients.append(c)
            out.append(c)
        self.wait(lambda: all(c.stream.error or c.stream.finish_reason or len(c.stream.tokens) >= min_tokens
                              for c in out), 60, "tokens flowing")
        return out

    def owners(self, run: Run) -> dict[str, list[str]]:
        """cell → ids of this run's requests it owns now (from the store)."""
        s = self.snapshot()
        out: dict[str, list[str]] = {}
        for c in run.clients:
            r = s["requests"].get(c.stream.request_id or "")
            if r is not None and r["cell"] is not None and r["state"] in checker.OWNED:
                out.setdefault(r["cell"], []).append(c.stream.request_id)
        return out

    # -- versions ---------------------------------------------------------------------------
    def publish(self, v: int, wait_active: bool = True) -> threading.Thread:
        """Put `v` in the version host, publish it, broadcast it on a thread (returned; its
        result lands in `self.last_broadcast`)."""
        self.weights.setdefault(v, version_weights(self.cfg, v))
        self.host.put(v, self.weights[v])
        a = self.host.address
        ref = self.history.invoke("trainer", "publish", version=v)
        self.http.put("/v1/trainer/version-host", json={"host": a.host, "port": a.port}).raise_for_status()
        r = self.http.post("/v1/versions", json={"version": v, "source": {"host": a.host, "port": a.port}})
        if r.status_code != 201:
            self.history.fail(ref, f"{r.status_code}: {r.text[:200]}")
            raise Hang(f"publish of version {v}: {r.status_code} {r.text[:200]}")
        receivers = r.json()["receivers"]
        self.complete.add(v)
        self.target = max(self.target, v)
        self.last_broadcast = None

        def bcast() -> None:
            res = self.host.broadcast(v, receivers)
            self.last_broadcast = res
            self.history.ok(ref, receivers=receivers, delivered=res.delivered, failed=res.failed,
                            attempts=res.num_attempts)

        t = threading.Thread(target=bcast, name=f"broadcast-{v}", daemon=True)
        t.start()
        return t

    def reference(self, v: int, client: Streamer) -> list[int]:
        from cells.engine.embedded import EmbeddedEngine
        from cells.engine.records import SamplingParams
        from scheduler.contract.config import parse_config

        eng = self._engines.get(v)
        if eng is None:
            w = self.weights.setdefault(v, version_weights(self.cfg, v))
            eng = self._engines[v] = EmbeddedEngine(parse_config(self.cfg).cells.engine, weights=w, version=v)
        eng.add_request(client.request_id, client.prompt, SamplingParams(max_tokens=client.max_tokens, seed=client.seed))
        out: list[int] = []
        while eng.has_work():
            out += [e.record.token_id for e in eng.step()]
        return out

    # -- one run ----------------------------------------------------------------------------
    def run_one(self, name: str, index: int, seed: int, k: int, canary: bool = False) -> Run:
        run = Run(name, index, seed, canary=canary, rng=random.Random(seed))
        ref = self.history.invoke("campaign", "run", scenario=name, index=index, seed=seed, canary=canary)
        t_start = time.monotonic()
        try:
            self.healthy(run)
        except Hang as e:
            run.hangs.append(f"before the run: {e}")
            self.hard_reset()
            self.healthy(run)
        with self._lock:
            self.run = run
        run.t0 = time.monotonic()
        run.mig_log_offset = self.mig_log.stat().st_size if self.mig_log.exists() else 0
        stalls_before = self.stall_count()
        try:
            SCENARIOS[name](self, run, k)
            self.settle(run)
        except Hang as e:
            run.hangs.append(str(e))
            self.log(f"  HANG in {name}: {e}")
        except Exception as e:  # a campaign bug, not a system fault: record it loudly
            run.hangs.append(f"campaign error: {e!r}")
            self.log(f"  ERROR in {name}: {e!r}")
        try:
            self.check(run)
        except Exception as e:  # a checker that crashes checked nothing: the run fails
            run.checker_errors.append(f"check: {e!r}")
            self.log(f"  CHECK ERROR in {name}: {e!r}")
        self.note_exits(run)
        run.stalls = self.stall_count() - stalls_before
        if run.stalls:
            run.notes.append(f"the stall watchdog re-placed {run.stalls} requests (cell logs: 'no token for')")
            self.log(f"  {run.notes[-1]}")
        try:
            self.healthy(run)
            run.t_healthy = time.monotonic()
        except Hang as e:
            run.hangs.append(f"recovery: {e}")
            self.log(f"  HANG recovering after {name}: {e}")
            self.hard_reset()
        with self._lock:
            self.run = None
        if run.t_fault is not None:
            run.recovery_s = checker.recovery_s(run.samples, run.t_fault,
                                                [c.stream.request_id for c in run.clients if c.stream.request_id])
            if run.recovery_s is None and not run.hangs:
                run.hangs.append("a request made no progress after the fault within the run")
            run.recoveries = client_recoveries(run)
        self.history.ok(ref, **{k: v for k, v in run.summary().items() if k not in ("scenario", "index", "seed")},
                        wall_s=time.monotonic() - t_start)
        self.runs.append(run)
        return run

    def stall_count(self) -> int:
        """Requests the scheduler's stall watchdog has taken back so far (its log outlives
        its restarts)."""
        path = self.cluster.tmp / "scheduler.log"
        if not path.exists():
            return 0
        n = 0
        for line in path.read_text(errors="replace").splitlines():
            if STALL_LOG_LINE in line:
                n += int(line.split(" reports ")[1].split()[0])
        return n

    def note_exits(self, run: Run) -> None:
        """Record processes that died on their own: a fault's SIGKILL is expected, a crash
        (an abort, an exception out of main) is not."""
        for name in ["scheduler", *(f"cell-{i}" for i in range(CELLS))]:
            p = self.cluster.procs.get(name)
            if p is None or p.poll() is None or p.returncode == -signal.SIGKILL or (name, p.pid) in self._exits_seen:
                continue
            self._exits_seen.add((name, p.pid))
            text = f"{name} (pid {p.pid}) exited with {p.returncode} on its own"
            run.exits.append(text)
            self.history.info("nemesis", "unexpected_exit", target=name, returncode=p.returncode, run=run.index)
            self.log(f"  {text}")

    def settle(self, run: Run) -> None:
        """Restart what the fault killed, wake what it stopped, let every request end."""
        nem = self.nem
        self.note_exits(run)
        if not nem.alive("scheduler"):
            nem.restart_scheduler()
        dead = {f"cell-{i}": None for i in range(CELLS) if not nem.alive(f"cell-{i}")}
        if dead:
            self.restart(dead)
        for i in range(CELLS):
            if nem.stopped(f"cell-{i}"):
                nem.signal(f"cell-{i}", signal.SIGCONT, "settle")
        ids = [c.stream.request_id for c in run.clients if c.stream.request_id]

        def ended() -> bool:
            s = run.samples[-1]["requests"] if run.samples else {}
            return all(s.get(r, {}).get("state") in checker.TERMINAL for r in ids)

        self.wait(ended, REQUEST_DEADLINE_S, f"requests {ids} ended")
        if run.flips:
            self.flips_done(run.flips, HEALTHY_DEADLINE_S)
        for c in run.clients:
            c.stream.join(10)

    # -- checks -----------------------------------------------------------------------------
    def check(self, run: Run) -> None:
        for c in run.clients:
            s = c.stream
            if s.is_alive():
                self.history.fail(c.ref, "stream still open", request_id=s.request_id, tokens=len(s.tokens))
            elif s.error:
                self.history.fail(c.ref, s.error, request_id=s.request_id, tokens=len(s.tokens))
            else:
                self.history.ok(c.ref, request_id=s.request_id, tokens=len(s.tokens), finish_reason=s.finish_reason)
        sessions = [c.stream.session_id for c in run.clients if c.stream.session_id]
        final = self.snapshot(sessions)
        out: list[str] = []
        token_versions: set[int | None] = set()
        for c in run.clients:
            s = c.stream
            r = final["requests"].get(s.request_id or "")
            rows = None
            expect = None
            if r is not None:
                rows = [(t[1], t[2], t[3], t[4]) for t in final["tokens"].get(r["session"], []) if t[0] >= r["base"]]
                token_versions |= {t[2] for t in rows}
                v = checker.single_version(rows)
                if r["state"] == "finished" and v is not None and v in self.complete:
                    expect = self.reference(v, s)
            client = {"request_id": s.request_id, "session_id": s.session_id, "max_tokens": s.max_tokens,
                      "tokens": list(s.tokens), "finish_reason": s.finish_reason, "error": s.error}
            vio, lost = checker.check_request(client, r, rows, expect)
            if s.session_id:  # what the client received against what the trainer is handed
                resp = self.http.get(f"/v1/sessions/{s.session_id}")
                vio += checker.check_client_vs_trainer(list(s.prompt), list(s.tokens), bool(s.finish_reason),
                                                       resp.json() if resp.status_code == 200 else None,
                                                       s.request_id or s.session_id)
            if s.replay_mismatch:
                vio.append(f"I1: the client of {s.request_id} was replayed other tokens than it first got "
                           f"({s.replay_mismatch})")
            failed = r is not None and r["state"] == "failed"
            run.failed += failed
            run.stream_errors += bool(s.error)
            run.reconnects += s.reconnects
            out += vio
            run.lost += bool(lost or failed or s.error)  # what a client feels: no answer, or an error one
        outcomes = []
        if self.mig_log.exists():
            with open(self.mig_log, "rb") as f:
                f.seek(run.mig_log_offset)
                for line in f.read().decode(errors="replace").splitlines():
                    try:
                        outcomes.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        for o in outcomes:
            self.history.info("cell", "migration_outcome", run=run.index,
                              **{k: o.get(k) for k in ("cell", "role", "result", "migration_id", "request_id", "reason")})
        out += checker.check_migration_outcomes(outcomes, final["migrations"])
        out += checker.check_token_epochs(final["requests"], final["migrations"], final.get("token_epochs", {}))
        with self._lock:
            served = set(self.served)
        once = checker.check_fenced_commits(final) + checker.check_foreign_batches(final.get("foreign_batches", []))
        once += checker.check_versions(served, token_versions, self.complete, self.partial)
        out += [v for v in once if v not in self._seen_once]  # store-wide checks: report each once
        self._seen_once.update(once)
        for v in out:
            if v not in run.violations:
                run.violations.append(v)
                self.history.info("checker", "violation", text=v, run=run.index)

    def check_restart(self, run: Run, before: dict) -> None:
        """I5: what the restarted scheduler serves extends what the killed one committed."""
        fl = self.http.get("/v1/flips").json()
        fl = fl["flips"] if isinstance(fl, dict) else fl
        flips = {f["id"]: f["state"] for f in fl}
        for fid in set(before["flips"]) - set(flips):  # past the list's window (newest 100)
            r = self.http.get(f"/v1/flips/{fid}")
            if r.status_code == 200:
                flips[fid] = r.json()["state"]
        after = {"flips": flips,
                 "versions": {v["version"]: v["state"] for v in self.http.get("/v1/versions").json()["versions"]},
                 "generations": {c["id"]: c["generation"] for c in self.cluster.cells()},
                 "sessions": {sid: self.http.get(f"/v1/sessions/{sid}").json()["token_ids"]
                              for sid in before["sessions"]},
                 "requests": self.snapshot()["requests"]}  # what the restarted scheduler's recovery wrote
        vio = checker.check_restart(before, after)
        self.history.info("checker", "restart", run=run.index, flips=len(before["flips"]),
                          sessions=len(before["sessions"]), requests=len(before["requests"]), violations=vio)
        for v in vio:
            if v not in run.violations:
                run.violations.append(v)
                self.history.info("checker", "violation", text=v, run=run.index)

    def committed_state(self, run: Run) -> dict:
        """The store as a dead scheduler left it (for I5)."""
        sids = [c.stream.session_id for c in run.clients if c.stream.session_id]
        s = self.snapshot(sids)
        newest = sorted(s["flip_rows"], key=lambda f: s["flip_rows"][f]["created_at"])[-100:]
        flips = {f: st for f, st in s["flips"].items() if f in newest or st in ("pending", "draining", "loading")}
        return {"flips": flips, "versions": s["versions"],
                "generations": {c: v["generation"] for c, v in s["cells"].items()},
                "sessions": {sid: [t[1] for t in rows] for sid, rows in s.get("tokens", {}).items()},
                "requests": s["requests"]}

    # -- the whole campaign -----------------------------------------------------------------
    def plan(self, runs: int, names: list[str] | None = None) -> list[tuple[str, int]]:
        """Round-robin over the scenarios in a seeded order; (name, k) with k the run's index
        within its scenario (it picks the failpoint / variant)."""
        names = list(names or SCENARIOS)
        rng = random.Random(self.seed)
        out, counts = [], dict.fromkeys(names, 0)
        while len(out) < runs:
            batch = names[:]
            rng.shuffle(batch)
            for n in batch[: runs - len(out)]:
                out.append((n, counts[n]))
                counts[n] += 1
        return out

    def execute(self, plan: list[tuple[str, int]], canary: bool = False,
                deadline: float | None = None) -> list[Run]:
        done = []
        if canary:
            self.nem.scheduler_env = {"CELLFLIP_CANARY_NO_FENCING": "1"}
            self.nem.restart_scheduler()
        try:
            for name, k in plan:
                if deadline is not None and time.monotonic() > deadline:
                    self.log(f"  time budget spent: {len(plan) - len(done)} runs left out")
                    break
                seed = random.Random(f"{self.seed}/{len(self.runs)}/{name}").randrange(1 << 31)
                t = time.monotonic()
                run = self.run_one(name, len(self.runs), seed, k, canary=canary)
                done.append(run)
                self.log(f"[{run.index:3d}] {'canary ' if canary else ''}{name:26s} k={k} "
                         f"{time.monotonic() - t:5.1f}s faults={len(run.faults)} "
                         f"recovery={max(run.recoveries) if run.recoveries else '-'} "
                         f"failed={run.failed} stream_errors={run.stream_errors} reconnects={run.reconnects} "
                         f"violations={len(run.violations)} lost={run.lost} hangs={len(run.hangs)} exits={len(run.exits)}"
                         + (f" {run.params}" if run.params else ""))
                for v in run.violations[:3] + run.hangs[:2]:
                    self.log(f"        {v[:300]}")
        finally:
            if canary:
                self.nem.scheduler_env = {}
                self.nem.restart_scheduler()
        return done


def client_recoveries(run: Run, in_flight_s: float = 0.3) -> list[float]:
    """For each request its client had not finished at the fault: seconds from the fault until
    its client got the next token (or its finish) — what the client felt, reconnects
    included. Tokens arriving within `in_flight_s` were sampled before the fault (one sync)
    and do not count as recovery. A request that got nothing more counts as the whole run."""
    t_fault = run.t_fault
    out = []
    for c in run.clients:
        s = c.stream
        if s.request_id is None or (s.finished_at is not None and s.finished_at <= t_fault) or not s.times:
            continue
        if s.times[0] > t_fault:
            continue  # started after the fault: not affected by it
        after = [t for t in s.times if t > t_fault + in_flight_s]
        ends = [t for t in (after[0] if after else None, s.finished_at) if t is not None and t > t_fault]
        out.append(round(min(ends) - t_fault, 3) if ends else round(time.monotonic() - t_fault, 3))
    return out


def summarize(runs: list[Run], canary_runs: list[Run]) -> dict:
    by: dict[str, dict] = {}
    recoveries: dict[str, list[float]] = {}
    for r in runs:
        b = by.setdefault(r.scenario, {"runs": 0, "faults_fired": 0, "unfired_faults": 0, "invariant_violations": 0,
                                       "lost_requests": 0, "failed_requests": 0, "stream_errors": 0,
                                       "client_reconnects": 0, "hangs": 0, "unexpected_exits": 0,
                                       "stalled_requests": 0, "affected_requests": 0, "max_healthy_s": 0.0,
                                       "checker_errors": 0, "params": [], "violations": []})
        b["runs"] += 1
        b["faults_fired"] += len(r.faults)
        b["unfired_faults"] += r.unfired
        b["invariant_violations"] += len(r.violations)
        b["lost_requests"] += r.lost
        b["failed_requests"] += r.failed
        b["stream_errors"] += r.stream_errors
        b["client_reconnects"] += r.reconnects
        b["hangs"] += bool(r.hangs)
        b["unexpected_exits"] += len(r.exits)
        b["stalled_requests"] += r.stalls
        b["checker_errors"] += len(r.checker_errors)
        recoveries.setdefault(r.scenario, []).extend(r.recoveries)
        healthy = r.summary()["healthy_s"]
        if healthy is not None:
            b["max_healthy_s"] = max(b["max_healthy_s"], healthy)
        if r.params and r.params not in b["params"]:
            b["params"].append(r.params)
        b["violations"] += [v for v in r.violations + r.hangs + r.exits + r.checker_errors
                            if v not in b["violations"]][:5]
    for name, b in by.items():
        rec = sorted(recoveries[name])
        b["affected_requests"] = len(rec)
        if rec:
            b["recovery_p50_s"] = rec[len(rec) // 2]
            b["recovery_max_s"] = rec[-1]
        else:  # nothing to recover: say so rather than report 0.0
            b["recovery_p50_s"] = b["recovery_max_s"] = None
            b["recovery"] = "no request in flight at any fault"
        b["max_healthy_s"] = round(b["max_healthy_s"], 3)
        b["violations"] = b["violations"][:5]
    canary_vio = [v for r in canary_runs for v in r.violations]
    every = [x for r in runs for x in r.recoveries]
    return {
        "scenarios": len(by),
        "runs": len(runs),
        "faults_fired": sum(len(r.faults) for r in runs),
        "unfired_faults": sum(r.unfired for r in runs),
        "invariant_violations": sum(len(r.violations) for r in runs),
        "lost_requests": sum(r.lost for r in runs),
        "failed_requests": sum(r.failed for r in runs),
        "stream_errors": sum(r.stream_errors for r in runs),
        "client_reconnects": sum(r.reconnects for r in runs),
        "hangs": sum(bool(r.hangs) for r in runs),
        "unexpected_exits": sum(len(r.exits) for r in runs),
        "stalled_requests": sum(r.stalls for r in runs),
        "affected_requests": len(every),
        "recovery_p50_s": sorted(every)[len(every) // 2] if every else None,
        "max_recovery_s": max(every) if every else None,
        "checker_errors": sum(len(r.checker_errors) for r in runs + canary_runs),
        "canary_violations": len(canary_vio),
        "canary_store_violations": sum(checker.STORE_HISTORY in v for v in canary_vio),
        "client_violations": sum(v.startswith(checker.CLIENT_VS_TRAINER) for r in runs for v in r.violations),
        "canary_client_violations": sum(v.startswith(checker.CLIENT_VS_TRAINER) for v in canary_vio),
        "canary_runs": len(canary_runs),
        "canary_faults_fired": sum(len(r.faults) for r in canary_runs),
        "canary_examples": sorted(set(canary_vio))[:5],
        "by_scenario": dict(sorted(by.items())),
    }


# -- scenarios -------------------------------------------------------------------------------
def _names(rng: random.Random) -> tuple[str, str, str]:
    s, d, x = rng.sample(range(CELLS), 3)
    return f"cell-{s}", f"cell-{d}", f"cell-{x}"


def _migration_setup(camp: Campaign, run: Run, armed: dict[str, dict[str, str]],
                     tokens: tuple[int, int] = (250, 400)) -> tuple[str, str, str, str | None]:
    """Every request on S, D the only other rollout cell, X training; then S flips to
    training, so S's requests migrate to D. `armed`: {"S"|"D": failpoints}."""
    S, D, X = _names(run.rng)
    run.params.update(source=S, destination=D)
    plan = {S if k == "S" else D: fps for k, fps in armed.items()}
    if plan:
        camp.restart(plan)
    camp.flip_all(run, [(X, "training"), (D, "training")])
    camp.start_clients(run, 3, tokens=tokens)
    camp.flip_all(run, [(D, "rollout")])
    fid = camp.post_flip(run, S, "training")
    return S, D, X, fid


def _maybe_wait_lease(camp: Campaign, run: Run) -> None:
    """Half the runs restart the victim at once (its new incarnation fences the old one),
    half only after its lease ran out (the scheduler fences it)."""
    if run.rng.random() < 0.5:
        time.sleep(LEASE_S * 1.5)
        run.params["restart"] = "after_lease"
    else:
        run.params["restart"] = "at_once"


def _mig_kill(camp: Campaign, run: Run, k: int, side: str, fps: list[str]) -> None:
    """SIGKILL the migration's source ("S") or destination ("D") at the k-th of its failpoints,
    then restart it (after its lease ran out, or at once)."""
    fp = fps[k % len(fps)]
    run.params["failpoint"] = fp
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*kill"}})
    victim = S if side == "S" else D
    if camp.await_fault(run, lambda: camp.nem.killed(victim), 30, "SIGKILL", victim, failpoint=fp):
        _maybe_wait_lease(camp, run)
        camp.restart({victim: None})


def scn_mig_kill_source(camp: Campaign, run: Run, k: int) -> None:
    _mig_kill(camp, run, k, "S", SRC_FPS)


def scn_mig_kill_destination(camp: Campaign, run: Run, k: int) -> None:
    _mig_kill(camp, run, k, "D", DST_FPS)


def scn_mig_raise(camp: Campaign, run: Run, k: int) -> None:
    fp = ALL_FPS[k % len(ALL_FPS)]
    side = "S" if fp in SRC_FPS else "D"
    run.params["failpoint"] = fp
    offsets = {f"cell-{i}": camp.nem.log_size(f"cell-{i}") for i in range(CELLS)}
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*raise"}})
    victim = S if side == "S" else D
    if camp.await_fault(run, lambda: camp.nem.log_has(victim, offsets[victim], f"failpoint {fp}"), 30, "raise",
                        victim, failpoint=fp):
        camp.nem.armed.pop(victim, None)  # a spent `1*raise` is harmless: no restart needed


def scn_partition_transfer(camp: Campaign, run: Run, k: int) -> None:
    """The destination's migration thread is held inside the transfer (no bytes flow): the
    source's own transfer timeout must fire, it aborts, keeps decoding, and the flip retries."""
    offsets = {f"cell-{i}": camp.nem.log_size(f"cell-{i}") for i in range(CELLS)}
    S, D, X, _ = _migration_setup(camp, run, {"D": {"migrate.transfer": "1*block"}})
    # the fault's time is when the transfer blocks (recovery counts from there, through the
    # source's timeout), not when the source reports its recovery
    if camp.await_fault(run, lambda: camp.nem.log_has(D, offsets[D], "failpoint migrate.transfer"), 30,
                        "partition", D, failpoint="migrate.transfer"):
        camp.wait(lambda: camp.nem.log_has(S, offsets[S], "failed at the source"), 60, "the source's timeout")
    # the held thread never returns: the destination is restarted (healed) by the next healthy()


def scn_zombie_cell(camp: Campaign, run: Run, k: int) -> None:
    """SIGSTOP a cell with requests past its lease, then SIGCONT: it must be fenced, its
    requests re-placed, and nothing it sends afterwards accepted."""
    camp.start_clients(run, 3)
    owners = camp.owners(run)
    victim = run.rng.choice(sorted(owners) or [f"cell-{i}" for i in range(CELLS)])
    run.params["victim"] = victim
    if camp.nem.signal(victim, signal.SIGSTOP, "zombie"):
        camp.fault(run, "SIGSTOP", victim)
        time.sleep(LEASE_S * 1.6)
        if camp.nem.signal(victim, signal.SIGCONT, "zombie wakes"):
            camp.fault(run, "SIGCONT", victim)


def scn_zombie_destination(camp: Campaign, run: Run, k: int) -> None:
    """The destination stops itself right after its commit, past its lease and past the
    source's transfer timeout: the source must not resume (the commit won), the zombie must
    be fenced when it wakes, the request continues elsewhere."""
    S, D, X, _ = _migration_setup(camp, run, {"D": {"migrate.after_commit": "1*stop"}})
    if camp.await_fault(run, lambda: camp.nem.stopped(D), 30, "SIGSTOP", D, failpoint="migrate.after_commit"):
        time.sleep(max(LEASE_S * 1.6, TRANSFER_TIMEOUT_S + 1.5))
        if camp.nem.signal(D, signal.SIGCONT, "zombie wakes"):
            camp.fault(run, "SIGCONT", D)


def scn_scheduler_kill_flip(camp: Campaign, run: Run, k: int) -> None:
    """The scheduler dies between recording a flip and acting on it; restarted, it carries
    the flip out (or rolls it back) exactly once, having lost nothing committed."""
    camp.nem.restart_scheduler({"flip.after_record": "1*kill"})
    camp.wait(lambda: all(c["state"] == "rollout" for c in camp.cells().values()), HEALTHY_DEADLINE_S,
              "cells re-synced")
    camp.start_clients(run, 3)
    owners = camp.owners(run)
    victim = run.rng.choice(sorted(owners) or ["cell-0"])
    run.params["cell"] = victim
    old = set(camp.snapshot()["flips"])
    camp.post_flip(run, victim, "training")  # the scheduler dies inside this call
    if not camp.await_fault(run, lambda: camp.nem.killed("scheduler"), 10, "SIGKILL", "scheduler",
                            failpoint="flip.after_record"):
        return
    before = camp.committed_state(run)
    recorded = [f for f in before["flips"] if f not in old]
    if not recorded:
        run.violations.append(f"I5: the flip of {victim} was not recorded before the scheduler died")
    camp.nem.restart_scheduler()
    camp.check_restart(run, before)
    run.flips += [f for f in recorded if f not in run.flips]


def scn_scheduler_kill_migration(camp: Campaign, run: Run, k: int) -> None:
    """A cell stops itself at a migration failpoint; the scheduler is SIGKILLed there and
    restarted; the cell continues: the migration ends exactly once (I5, I2)."""
    fps = [f for f in ALL_FPS if f != "migrate.transfer"]
    fp = fps[k % len(fps)]
    run.params["failpoint"] = fp
    side = "S" if fp in SRC_FPS else "D"
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*stop"}})
    victim = S if side == "S" else D
    if not camp.await_fault(run, lambda: camp.nem.stopped(victim), 30, "SIGSTOP", victim, failpoint=fp):
        return
    if camp.nem.signal("scheduler", signal.SIGKILL, f"at {fp}"):
        camp.fault(run, "SIGKILL", "scheduler", failpoint=fp)
    before = camp.committed_state(run)  # the store as the dead scheduler left it
    camp.nem.restart_scheduler(wait_ready=False)  # the stopped cell must be back within the grace
    camp.nem.signal(victim, signal.SIGCONT, "resume after the scheduler restart")
    camp.nem.wait_ready()
    camp.check_restart(run, before)


def scn_trainer_kill_broadcast(camp: Campaign, run: Run, k: int) -> None:
    """The trainer dies mid-broadcast: no cell may serve the half-sent version; the restarted
    trainer publishes the next version and every cell moves to it."""
    v = camp.next_version
    camp.next_version += 2
    run.params["version"] = v
    p = camp.nem.start_trainer(v, {"broadcast.mid_bucket": "2*kill"}, BUCKET_BYTES, TRANSFER_TIMEOUT_S)
    camp.partial.add(v)
    camp.wait(lambda: p.poll() is not None or f'"ready": {p.pid}' in (camp.cluster.tmp / "trainer.log").read_text(),
              60, "the trainer holds its version")
    camp.start_clients(run, 3)
    camp.nem.go_trainer(p)
    camp.wait(lambda: p.poll() is not None, 60, "the trainer dies mid-broadcast")
    if p.returncode == -signal.SIGKILL:
        camp.fault(run, "SIGKILL", "trainer", failpoint="broadcast.mid_bucket", version=v)
        time.sleep(run.rng.uniform(0.0, 1.0))  # the receivers notice on their own timeouts
        t = camp.publish(v + 1)  # the restarted trainer publishes its next version
        t.join(60)
        if t.is_alive():
            raise Hang(f"broadcast of version {v + 1} after the trainer restart")
    else:
        run.notes.append(f"the trainer exited with {p.returncode}, see trainer.log")
        camp.partial.discard(v)


def scn_broadcast_receiver(camp: Campaign, run: Run, k: int) -> None:
    """A receiving cell dies (or its receiving thread stalls) mid-bucket: the trainer finishes
    the others, the cell catches up point to point, nobody serves a partial version. Every op
    is posted at once, so the bytes keep arriving while the thread stalls: the stall outlasts
    the sender's wait for reports (an op timeout + SETTLE_EXTRA_S) to leave the cell unreported."""
    variant = ["kill", "stall"][k % 2]
    victim = f"cell-{run.rng.randrange(CELLS)}"
    run.params.update(variant=variant, victim=victim)
    action = "2*kill" if variant == "kill" else f"2*sleep:{TRANSFER_TIMEOUT_S + SETTLE_EXTRA_S + 1.5}"
    camp.restart({victim: {"broadcast.mid_bucket": action}})
    camp.start_clients(run, 3)
    v = camp.next_version
    camp.next_version += 1
    run.params["version"] = v
    t = camp.publish(v)
    if variant == "kill":
        if camp.await_fault(run, lambda: camp.nem.killed(victim), 60, "SIGKILL", victim,
                            failpoint="broadcast.mid_bucket"):
            camp.restart({victim: None})
    t.join(90)
    if t.is_alive():
        raise Hang(f"broadcast of version {v}")
    res = camp.last_broadcast
    if variant == "stall" and res is not None and (res.failed or res.num_attempts > 1):
        camp.fault(run, "stall", victim, failpoint="broadcast.mid_bucket", attempts=res.num_attempts,
                   failed=sorted(res.failed))
    elif variant == "stall":
        run.notes.append(f"stall did not disturb the broadcast: {res}")


def scn_scoring_fault(camp: Campaign, run: Run, k: int) -> None:
    """A cell dies (or its scoring fails) at a scoring task while a superseded version's
    tokens get their old log-probs: the version retires only once every token is scored."""
    variant = ["kill", "raise"][k % 2]
    victim = f"cell-{run.rng.randrange(CELLS)}"
    run.params.update(variant=variant, victim=victim)
    camp.restart({victim: {"logprob.final_pass": f"1*{variant}"}})
    offset = camp.nem.log_size(victim)
    hit = (lambda: camp.nem.killed(victim)) if variant == "kill" else (
        lambda: camp.nem.log_has(victim, offset, "failpoint logprob.final_pass"))
    # a range is scored by a verified cell other than its sampler, the least loaded (ties spread
    # by the range): the victim gets a final-pass task within a round or two of versions
    for attempt in range(3):
        camp.start_clients(run, 3, min_tokens=20)
        v = camp.next_version
        camp.next_version += 1
        run.params["version"] = v
        t = camp.publish(v)
        deadline = time.monotonic() + 30
        while not hit() and time.monotonic() < deadline:
            time.sleep(0.05)
        t.join(90)
        if hit() or attempt == 2:
            break
    kind = "SIGKILL" if variant == "kill" else "raise"
    if camp.await_fault(run, hit, 30, kind, victim, failpoint="logprob.final_pass"):
        if variant == "kill":
            camp.restart({victim: None})
        else:
            camp.nem.armed.pop(victim, None)


def _training_batch(spec, seed: int) -> list[dict]:
    """Synthetic finished trajectories over the model's output ids (4 groups of 3, exact old
    log-probs): what a training step consumes."""
    rng = random.Random(seed)
    ids = spec.output_ids() or list(range(spec.vocab_size))
    out = []
    for g in range(4):
        prompt = [rng.choice(ids) for _ in range(rng.randrange(4, 12))]
        for i in range(3):
            toks = prompt + [rng.choice(ids) for _ in range(rng.randrange(3, 16))]
            m = [j >= len(prompt) for j in range(len(toks))]
            out.append({"id": f"t{seed}-{g}-{i}", "reward": float(rng.random() < 0.5) + 0.1 * i, "group_id": f"g{g}",
                        "segment_starts": [0], "token_ids": toks, "loss_mask": [int(x) for x in m],
                        "logprobs": [-2.0 if x else None for x in m], "versions": [0 if x else None for x in m],
                        "old_logprobs": [-2.0 if x else None for x in m],
                        "provenance": ["exact" if x else None for x in m]})
    return out


def scn_training_rank_fault(camp: Campaign, run: Run, k: int) -> None:
    """A training cell dies (SIGKILL) or stalls (SIGSTOP) in the middle of an update: the step
    is redone by the other training cell from the start-of-update state it restored (the
    coordinator holds none; the state it reads back is a cell's checkpoint). Checked:
    the parameters equal a fault-free update of the same batch (max over tensors of
    ||a - b|| / ||a - theta_0|| <= 1e-3), one version number is taken, and only after the redo."""
    from cells.engine.embedded.checkpoint import save_checkpoint
    from cells.engine.embedded.model_spec import resolve_spec
    from cells.rl.learner import Learner
    from cells.rl.objectives import ObjectiveConfig
    from cells.training import protocol as P
    from cells.training import state_files
    from cells.training.coordinator import TrainingCoordinator
    from cells.training.wire import params_view
    from scheduler.contract.config import parse_config

    variant = ["kill", "stop"][k % 2]
    victim, other, _ = _names(run.rng)
    run.params.update(variant=variant, victim=victim, other=other)
    camp.restart({victim: {"training.after_minibatch": f"1*{variant}"}})
    v = camp.next_version  # a version command tells every cell where the coordinator's store is
    camp.next_version += 1
    camp.publish(v).join(60)
    camp.flip_all(run, [(victim, "training"), (other, "training")])
    camp.start_clients(run, 3)  # rollouts go on on the third cell throughout
    spec = resolve_spec(parse_config(camp.cfg).cells.engine.model)
    batch = _training_batch(spec, run.seed)
    # the guard off: this checks the redo of a kept update (a rejected one takes no number)
    clean = Learner(spec, camp.weights[v], lr=2e-3, minibatches=2, objective=ObjectiveConfig(max_update_kl=None))
    start = save_checkpoint(camp.workdir / f"start-{run.seed}", spec, camp.weights[v])  # the ranks build from it
    clean_before = {n: t.clone() for n, t in camp.weights[v].items()}
    clean.rl_step(batch)
    taken: list[int] = []
    coord = TrainingCoordinator(P.hyper(clean), P.skeleton(clean)["params"], camp.host.address,
                                start={"kind": "path", "path": str(start)}, timeout_s=TRANSFER_TIMEOUT_S + 2,
                                ack_timeout_s=15, emit=lambda rec: camp.history.info("trainer", rec.get("event", "train"), **{
                                    k2: v2 for k2, v2 in rec.items() if k2 != "event" and isinstance(v2, (int, float, str))}))
    coord.lr = 2e-3
    m = coord.update(batch, [victim, other], next_version=lambda: taken.append(coord.version + 1) or coord.version + 1)
    gone = camp.nem.killed(victim) if variant == "kill" else camp.nem.stopped(victim)
    if gone and m["attempts"] >= 2:
        camp.fault(run, "SIGKILL" if variant == "kill" else "SIGSTOP", victim,
                   failpoint="training.after_minibatch", attempts=m["attempts"], cells_lost=m["cells_lost"])
    else:
        run.notes.append(f"training fault on {victim} did not disturb the step: {gone}, attempts {m['attempts']}")
    path = camp.workdir / f"state-{run.seed}"
    done = coord.checkpoint_done(coord.checkpoint(str(path)), str(path), 60)  # the state, from the cell holding it
    meta, flat, _ = state_files.load_packed(path) if done.get("ok") else ({"entries": []}, None, None)
    after = params_view(meta, flat) if flat is not None else {}
    diff = 0.0 if after else float("inf")
    for name, p in clean.params.items():
        den = float((p.detach() - clean_before[name]).norm())
        if den > 0 and name in after:
            diff = max(diff, float((p.detach() - after[name]).norm()) / den)
    run.params.update(param_rel_diff=diff, attempts=m["attempts"], restored=m["join_cells"] == 0)
    if diff > 1e-3:
        run.violations.append(f"training: the update after the fault differs from the fault-free one ({diff:.2e})")
    if len(taken) != 1:
        run.violations.append(f"training: version numbers taken {taken} (a partial update was committed)")
    camp.restart({victim: None})
    camp.flip_all(run, [(other, "rollout")])


def scn_rogue_cell(camp: Campaign, run: Run, k: int) -> None:
    """A process holding the cell token plays a cell (faultkit/rogue.py): one whose probe no model
    gives is refused at registration; one that holds the model and then reports an
    out-of-vocabulary token, a -inf log-prob or log-probs that are not its tokens' is quarantined
    (at its sync, or when a verified cell's exact scoring contradicts it). Nothing it sampled is
    ever handed out for training, and the fleet serves throughout (the run's clients)."""
    from cells.agent.cell import probe_answer
    from cells.engine.embedded import EmbeddedEngine
    from faultkit.rogue import MODES, RogueCell
    from scheduler.contract.config import parse_config

    mode = MODES[k % len(MODES)]
    run.params["mode"] = mode
    eng_cfg = parse_config(camp.cfg).cells.engine
    boot = EmbeddedEngine(eng_cfg)  # what a fresh cell process holds: version 0's weights
    v = camp.target
    serve = EmbeddedEngine(eng_cfg, weights=camp.weights.setdefault(v, version_weights(camp.cfg, v)), version=v) \
        if v else boot
    name = f"rogue-{run.index}"
    rogue = RogueCell(camp.cluster.url, camp.cluster.tokens["cell"], name, mode, serve,
                      probe_answer(boot, boot.version), boot.version, v, boot.capabilities.vocab_size)
    rogue.start()
    camp.start_clients(run, 3)
    if mode == "bad_probe":
        rogue.join(30)
        code, body = rogue.register_answer or (None, {})
        if code == 409 and body.get("reason") == "probe_mismatch":
            camp.fault(run, "probe_refused", name)
        else:
            run.violations.append(f"rogue: a cell answering the probe wrongly registered ({code}: {body})")
        return
    # more clients until one request lands on the rogue (it is verified: it holds the model)
    deadline = time.monotonic() + 60
    while not rogue.given and time.monotonic() < deadline and not rogue.fenced.is_set():
        camp.start_clients(run, 1, min_tokens=0)
        time.sleep(0.5)
    if not camp.await_fault(run, lambda: _trust_of(camp, name) == "quarantined", 90, "quarantined", name,
                            given=len(rogue.given)):
        run.violations.append(f"rogue: {mode} was not quarantined (given {len(rogue.given)} requests)")
    rogue.stop.set()
    rogue.join(10)
    untrusted = _untrusted_sessions(camp, name)
    if untrusted:
        run.violations.append(f"rogue: sessions holding tokens {name} sampled are not kept from training: {untrusted}")


def _trust_of(camp: Campaign, cell_id: str) -> str | None:
    with camp._conn_lock:
        r = camp._conn2.execute("SELECT trust FROM cells WHERE id = ?", (cell_id,)).fetchone()
    return r[0] if r else None


def _untrusted_sessions(camp: Campaign, cell_id: str) -> list[str]:
    """Sessions holding tokens `cell_id` sampled that are not marked never to be trained."""
    with camp._conn_lock:
        rows = camp._conn2.execute("SELECT DISTINCT t.session_id FROM tokens t JOIN sessions s ON s.id = t.session_id"
                                   " WHERE t.cell = ? AND s.tainted = 0", (cell_id,)).fetchall()
    return [r[0] for r in rows]


SCENARIOS: dict[str, Callable[[Campaign, Run, int], None]] = {
    "mig_kill_source": scn_mig_kill_source,
    "mig_kill_destination": scn_mig_kill_destination,
    "mig_raise": scn_mig_raise,
    "partition_transfer": scn_partition_transfer,
    "zombie_cell": scn_zombie_cell,
    "zombie_destination": scn_zombie_destination,
    "scheduler_kill_flip": scn_scheduler_kill_flip,
    "scheduler_kill_migration": scn_scheduler_kill_migration,
    "trainer_kill_broadcast": scn_trainer_kill_broadcast,
    "broadcast_receiver": scn_broadcast_receiver,
    "scoring_fault": scn_scoring_fault,
    "training_rank_fault": scn_training_rank_fault,
    "rogue_cell": scn_rogue_cell,
}

CANARY_PLAN = [("zombie_destination", 0), ("mig_kill_destination", DST_FPS.index("migrate.after_commit")),
               ("zombie_cell", 0)]
"""The canary run: the scenarios where split ownership is one refused message away: the
destination of a migration committed, then went silent or died past the source's transfer
timeout (the cells' migration logs show the split); a cell stopped past its lease wakes and
syncs the tokens it decoded for requests re-placed meanwhile (the store's own token history
shows them)."""

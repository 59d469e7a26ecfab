"""The campaign's cluster and its operations (flips, restarts, publishes, clients)."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from cells.agent.owned import SYNC_LOG_ENV
from cells.localcluster import Cluster, Streamer
from faultkit import checker
from faultkit.history import History
from faultkit.nemesis import Nemesis, version_weights
from faultkit.runs import Client, Run
from faultkit.settings import (
    BUCKET_BYTES,
    CELLS,
    HEALTHY_DEADLINE_S,
    REQUEST_DEADLINE_S,
    SAMPLE_S,
    TRANSFER_TIMEOUT_S,
    Hang,
    campaign_config,
)
from faultkit.storeview import open_store, read_store


class Fleet:
    """The cluster a campaign drives: its processes, the store sampler, and the operations a
    scenario performs (flips, restarts, publishes, clients), each recorded in the history."""

    def __init__(self, workdir: Path, seed: int = 0, log: Callable[[str], None] = print) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.log = log
        self.history = History(self.workdir / "history.jsonl")
        self.cfg = campaign_config(self.workdir)
        self.db_path = self.cfg["scheduler"]["db_path"]
        self.mig_log = self.workdir / "migrations.jsonl"
        self.sync_log = self.workdir / "syncs.jsonl"
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
        # every cell logs its migrations' ends and the token batches the scheduler took from it
        logs = {"CELLFLIP_MIGRATION_LOG": str(self.mig_log), SYNC_LOG_ENV: str(self.sync_log)}
        saved = {k: os.environ.get(k) for k in logs}
        os.environ.update(logs)
        try:
            self.cluster = Cluster(self.workdir / "cluster", num_cells=CELLS, cfg=self.cfg)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
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

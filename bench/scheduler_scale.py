"""How long does a controller tick take at 10,000 cells and 1,000,000 sessions, and how fast is
the REST API in front of it at 10,000 registered cells?

Tick = what the controller does each tick to plan: `Controller.snapshot()` over its SQLite
store (10,000 cells; 1,000,000 session rows: 32,768 finished, the trainer's backlog, and one
live request each for the rest, on the rollout cells), then `plan_flips`, the live requests
of every cell flipped to training (`requests_on`), and `choose_destinations` for them. No
`gc.freeze()`: the scheduler does not call it. Between ticks (untimed) the fleet moves through
the store: a share of the rollout cells finish sessions, admit new ones and decode further
(each then syncs its KV blocks in use), the trainer runs up to 8 steps at once, the backlog
of finished trajectories wanders (so the planner flips both ways), and the last tick's flips
and placements are written back; then the controller's GC policy steps, as the running loop
does after each tick (scheduler/contract/gcpolicy.py: the fleet's long-lived state frozen out of
the automatic collections). The scheduled full collection (every 10 minutes in production) is
timed apart at the end: `gc_full_ms`.

REST: the real app (`scheduler.api.app.create_app_from_env`) under uvicorn on 127.0.0.1, in a
process of its own as deployed, with its SQLite store holding 10,000 rollout cells (as a
restarted scheduler finds them) that each synced, with its bearer token and its control loop
running; a bounded loop of sequential requests over one keep-alive connection from this
process (the standard library's HTTP client: its own cost per request is small beside the
server's, so the rate is the server's): GET /v1/cells/{id} and POST /v1/flips {"count": 1}.
Any answer but 200/202 fails the run.

    python bench/scheduler_scale.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import add_target_args, finish  # noqa: E402

from scheduler.contract.config import SchedulerConfig  # noqa: E402
from scheduler.contract.protocol import Summary  # noqa: E402
from scheduler.control.controller import Controller  # noqa: E402
from scheduler.control.rates import TrainerDemand  # noqa: E402
from scheduler.planner.destinations import choose_destinations  # noqa: E402
from scheduler.planner.plan import plan_flips  # noqa: E402
from scheduler.planner.types import RequestSummary  # noqa: E402
from scheduler.store import Store  # noqa: E402

CAPACITY = 128
"""Sessions per rollout cell (1,000,000 sessions on ~9,000 rollout cells)."""
BATCH = 1024
TRAIN_RATE = BATCH / (32 * 3600.0)
SLOT_RATE = TRAIN_RATE / 9 / CAPACITY
"""Per-slot finish rate that puts the balance at about 10 % training cells."""
STEPS_AT_ONCE = 8
"""Training steps the trainer runs at once (so the planner flips toward training when the
backlog holds batches, and back when it runs dry)."""
API_CELLS = 10_000
"""Cells registered (and synced) before the REST loop."""
TOKENS_PER_SESSION = 20_000
BLOCK = 16
KV_BLOCKS = CAPACITY * TOKENS_PER_SESSION // BLOCK
FINISHED = 32 * BATCH
"""Of the session rows, finished ones (no live request): the trainer's backlog wanders in them."""
CAPS = json.dumps({"kv_export": True, "block_size": BLOCK})
_REQ = ("INSERT INTO requests(id, session_id, base, prompt_start, num_generated, params, cell_id, epoch, "
        "state, reason, created_at, updated_at) VALUES (?,?,?,0,?,'{}',?,1,'running',NULL,?,?)")
_SESSION = ("INSERT INTO sessions(id, state, length, segment_starts, created_at) "
            "VALUES (?, 'open', ?, '[0]', ?)")


def _spread(rng: random.Random, cells: list[str], sessions: int) -> dict[str, int]:
    """Sessions per rollout cell, even with some jitter, at most CAPACITY each."""
    out, left = {}, sessions
    for k, c in enumerate(cells):
        share = left // (len(cells) - k)
        out[c] = min(CAPACITY, max(0, share + rng.randint(-8, 8)))
        left -= out[c]
    return out


class StoreFleet:
    """A controller over a store with the fleet and its sessions, moved by SQL between ticks."""

    def __init__(self, path: str, cells: int, sessions: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = [f"cell-{i:05d}" for i in range(cells)]
        n_train = cells // 10
        self.store = Store(path)
        self.seq = 0
        inflight = _spread(self.rng, self.ids[n_train:], sessions - FINISHED)
        now = time.time()
        with self.store.tx(durable=False):
            self.store.executemany(
                "INSERT INTO sessions(id, state, length, segment_starts, finish_seq, created_at) "
                "VALUES (?, 'finished', ?, '[0]', ?, ?)",
                [(f"f{j}", TOKENS_PER_SESSION, j + 1, now) for j in range(FINISHED)])
            self.store.executemany(
                "INSERT INTO cells(id, incarnation, state, generation, version, address, store_port, capabilities, "
                "kv_blocks_total, kv_blocks_used, max_running, history, trust) "
                "VALUES (?,?,?,1,0,?,1,?,?,0,?,'[]','verified')",
                [(c, f"inc-{c}", "training" if i < n_train else "rollout", f"node{i // 8}:{20000 + i}", CAPS,
                  KV_BLOCKS, CAPACITY) for i, c in enumerate(self.ids)])
            for c, n in inflight.items():
                self._admit(c, n, now)
            self.store.execute("INSERT INTO versions(v, state, created_at, history) VALUES (0, 'active', ?, '[]')",
                               (now,))
        self.ctl = Controller(self.store, SchedulerConfig(db_path=path, min_rollout_cells=1, lease_s=1e9,
                                                               staleness_bound=40))
        self.ctl.rates.on_trainer_report(TrainerDemand(BATCH, max(1, cells // 10 // 128), 128, STEPS_AT_ONCE))
        self.ctl.rates.train_rate_per_cell_s = TRAIN_RATE
        self.ctl.rates.finishes, self.ctl.rates.occupied_slot_s = 1e6, 1e6 / SLOT_RATE
        for c in self.ids:
            self._sync(c)
        self.waiting = 2 * BATCH

    def _admit(self, cell: str, n: int, now: float) -> None:
        first = self.seq
        self.seq += n
        ids = [f"s{j}" for j in range(first, self.seq)]
        self.store.executemany(_SESSION, [(s, TOKENS_PER_SESSION, now) for s in ids])
        ctx = [self.rng.randint(1000, 2 * TOKENS_PER_SESSION // 2) for _ in ids]
        self.store.executemany(_REQ, [(f"r-{s}", s, t // 2, t - t // 2, cell, now, now) for s, t in zip(ids, ctx)])

    def _sync(self, cell: str) -> None:
        """The cell's sync: its KV blocks in use follow its live requests."""
        used = self.store.owners.load_of(cell)[0] * TOKENS_PER_SESSION // BLOCK
        self.ctl.ctx.registry.renew(cell, 1e9, Summary(kv_blocks_used=used, kv_blocks_total=KV_BLOCKS, version=0))

    def sessions(self) -> int:
        return self.store.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]

    def churn(self, share: float) -> None:
        """Between ticks: `share` of the rollout cells finish a few sessions, admit a few and
        decode further; the backlog moves by up to two batches either way."""
        now, st = time.time(), self.store
        with st.tx(durable=False):
            for c in self.rng.sample(self.ids, int(share * len(self.ids))):
                if st.execute("SELECT state FROM cells WHERE id=?", (c,)).fetchone()[0] != "rollout":
                    continue
                live = [r[0] for r in st.execute(
                    "SELECT id FROM requests WHERE cell_id=? AND state='running' LIMIT 3", (c,))]
                done = live[: self.rng.randint(0, len(live))]
                st.executemany("UPDATE requests SET state='finished' WHERE id=?", [(r,) for r in done])
                room = CAPACITY - self.ctl.store.owners.load_of(c)[0]
                self._admit(c, min(room, self.rng.randint(0, 3)), now)
                st.execute("UPDATE requests SET num_generated = num_generated + 16 "
                           "WHERE cell_id=? AND state='running'", (c,))
                self._sync(c)
        self.waiting = min(FINISHED, max(0, self.waiting + self.rng.randint(-2 * BATCH, 2 * BATCH)))
        self.ctl.staleness.trajectory_cursor = FINISHED - self.waiting  # the trainer fetched the rest

    def apply(self, decisions, moves, dests) -> None:
        """The tick's flips and placements, written back as the controller would end them."""
        st = self.store
        with st.tx(durable=False):
            for d in decisions:
                st.execute("UPDATE cells SET state=?, generation=generation+1 WHERE id=?", (d.to, str(d.cell_id)))
            st.executemany("UPDATE requests SET cell_id=? WHERE id=?",
                           [(str(x.cell_id), str(req.request_id)) for (_, req), x in zip(moves, dests)
                            if x.cell_id is not None])
            st.executemany("UPDATE requests SET state='suspended' WHERE id=?",
                           [(str(req.request_id),) for (_, req), x in zip(moves, dests) if x.cell_id is None])
        for c in {str(d.cell_id) for d in decisions} | {str(x.cell_id) for x in dests if x.cell_id is not None}:
            self._sync(c)


def controller_tick(fleet: StoreFleet) -> tuple[float, int, int, list, list, list]:
    """One timed tick: (seconds, flips, placements, decisions, moves, destinations)."""
    t0 = time.perf_counter()
    snap = fleet.ctl.snapshot()
    decisions = plan_flips(snap)
    moves = []
    for d in decisions:
        if d.to == "training":
            for q in fleet.ctl.store.owners.requests_on(str(d.cell_id)):
                moves.append((d.cell_id, RequestSummary(q.id, q.num_tokens, 0)))
    dests = choose_destinations(snap, moves) if moves else []
    dt = time.perf_counter() - t0
    return dt, len(decisions), len(dests), decisions, moves, dests


def bench_tick(cells: int, sessions: int, ticks: int, seed: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="cellflip-scale-")
    t0 = time.perf_counter()
    fleet = StoreFleet(f"{tmp}/scheduler.sqlite", cells, sessions, seed)
    assert abs(fleet.sessions() - sessions) <= cells, "the store does not hold the sessions asked for"
    print(f"store: {cells} cells, {fleet.sessions()} sessions built in {time.perf_counter() - t0:.0f} s")
    times, flips, placed = [], [], []
    for k in range(5 + ticks):  # five warm-up ticks
        fleet.churn(0.02)
        dt, f, p, decisions, moves, dests = controller_tick(fleet)
        fleet.apply(decisions, moves, dests)
        fleet.ctl.gc_policy.step()  # as the running loop does after each tick
        if k >= 5:
            times.append(dt * 1e3)
            flips.append(f)
            placed.append(p)
    times.sort()
    # the scheduled full collection (once every FULL_EVERY_S in production): its pause at this scale
    policy = fleet.ctl.gc_policy
    pauses: list[float] = []
    policy.observe, policy.last_full = pauses.append, float("-inf")
    policy.step()
    return {"gc_full_ms": round(pauses[0] * 1e3, 1),
            "tick_p50_ms": round(statistics.median(times), 2),
            "tick_p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 2),
            "tick_max_ms": round(times[-1], 2),
            "flips_per_tick": round(statistics.mean(flips), 2),
            "placements_per_tick": round(statistics.mean(placed), 1),
            "decisions_per_tick": round(statistics.mean(f + p for f, p in zip(flips, placed)), 1)}


# ---------------------------------------------------------------- REST

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seed(path: str, n_cells: int) -> None:
    """`n_cells` rollout cells in the store, as a restarted scheduler finds them (each must then
    sync within its lease: `_sync`). Registering 10,000 cells one by one is not what is measured."""
    store = Store(path)
    with store.tx():
        store.executemany("INSERT INTO cells(id, incarnation, state, generation, version, address, store_port, "
                          "capabilities, kv_blocks_total, kv_blocks_used, max_running, history, trust) "
                          "VALUES (?,?,'rollout',1,0,?,30000,?,1024,0,16,'[]','verified')",
                          [(f"cell-{i}", f"inc-{i}", f"10.0.{i // 250}.{i % 250}:20000", CAPS) for i in range(n_cells)])
    store.close()


def _sync(base: str, headers: dict, ids: range) -> None:
    """Each cell's sync to the (restarted) scheduler (one keep-alive client)."""
    import httpx

    with httpx.Client(base_url=base, headers=headers, timeout=60.0) as client:
        for i in ids:
            client.post(f"/internal/v1/cells/cell-{i}/sync", json={
                "incarnation": f"inc-{i}", "summary": {"inflight": 0, "kv_blocks_used": 0, "kv_blocks_total": 1024,
                                                       "version": 0, "request_ids": [], "role": "rollout"}}
                        ).raise_for_status()


def _rate(seconds: float, fn, limit: int) -> tuple[float, int, dict[int, int]]:
    codes: dict[int, int] = {}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and n < limit:
        code = fn(n)
        codes[code] = codes.get(code, 0) + 1
        n += 1
    return n / (time.perf_counter() - t0), n, codes


class _KeepAlive:
    """One keep-alive HTTP/1.1 connection (the standard library's client): the loop's own cost
    per request is a small share of the server's, so the rate is the server's. (httpx, the
    cells' client, costs ~1 ms a request here itself: a loop over it measured httpx.)"""

    def __init__(self, port: int, headers: dict) -> None:
        import http.client

        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
        self.headers = headers

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> int:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {**self.headers, **(headers or {}), **({"Content-Type": "application/json"} if data else {})}
        self.conn.request(method, path, body=data, headers=hdrs)
        resp = self.conn.getresponse()
        resp.read()
        return resp.status

    def close(self) -> None:
        self.conn.close()


def bench_api(seconds: float, n_cells: int) -> dict | None:
    """req/s of the real app for GET /v1/cells/{id} and POST /v1/flips at `n_cells` registered
    cells (with its bearer token, as deployed); None if there is no app. The server runs in a
    process of its own (as deployed): the client's own cost is not the server's."""
    try:
        import httpx
        import uvicorn  # noqa: F401

        from scheduler.contract.config import SCHEDULER_CONFIG_ENV, CellflipConfig
        from scheduler.contract.tokens import server_tokens
    except ImportError as e:
        print(f"api: skipped ({e})")
        return None
    tmp = tempfile.mkdtemp(prefix="cellflip-scale-")
    port = _free_port()
    cfg = SchedulerConfig(port=port, db_path=f"{tmp}/scheduler.sqlite", min_rollout_cells=1, lease_s=3600.0)
    _seed(cfg.db_path, n_cells)
    tokens = server_tokens(cfg)  # made here, read by the server; each client with its own scope
    headers = {"Authorization": f"Bearer {tokens['trainer']}"}
    cell_headers = {"Authorization": f"Bearer {tokens['cell']}"}
    env = {**os.environ, SCHEDULER_CONFIG_ENV: CellflipConfig(scheduler=cfg).model_dump_json(),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "scheduler.api.app:create_app_from_env",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                               "--no-access-log"], env=env, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/healthz", headers=headers, timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not start (exit code {server.poll()})")
            time.sleep(0.2)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:  # not what is measured: in parallel
            list(pool.map(lambda k: _sync(base, cell_headers, range(k, n_cells, 8)), range(8)))
        print(f"api: {n_cells} cells synced in {time.perf_counter() - t0:.0f} s")
        client = _KeepAlive(port, headers)
        try:
            get_rps, n_get, get_codes = _rate(seconds, lambda i: client.call("GET", f"/v1/cells/cell-{i % n_cells}"),
                                              10**9)
            # each flip takes one more rollout cell (the planner picks it): stop before they run out
            flip_rps, n_flip, flip_codes = _rate(seconds, lambda i: client.call(
                "POST", "/v1/flips", {"count": 1, "to": "training"}, {"Idempotency-Key": f"k-{i}"}), n_cells - 1)
        finally:
            client.close()
        print(f"api: {n_cells} cells; GET /v1/cells/{{id}} {get_rps:.0f} req/s ({n_get} requests, status "
              f"{get_codes}); POST /v1/flips {flip_rps:.0f} req/s ({n_flip} requests, status {flip_codes})")
        if set(get_codes) != {200} or set(flip_codes) != {202}:
            raise RuntimeError(f"the REST loop was answered with errors: GET {get_codes}, POST {flip_codes}")
        return {"api_rps_get": round(get_rps, 1), "api_rps_flip": round(flip_rps, 1)}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer ticks and a shorter API loop")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--cells", type=int, default=10_000)
    ap.add_argument("--sessions", type=int, default=1_000_000)
    ap.add_argument("--api-cells", type=int, default=API_CELLS, help="cells registered for the REST loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-api", action="store_true", help="skip the REST measurement")
    add_target_args(ap)
    args = ap.parse_args()
    ticks = 60 if args.quick else 300
    tick = bench_tick(args.cells, args.sessions, ticks, args.seed)
    print(f"tick (snapshot + planner): {args.cells} cells, {args.sessions} sessions, {ticks} ticks: "
          f"p50 {tick['tick_p50_ms']} ms, p99 {tick['tick_p99_ms']} ms, max {tick['tick_max_ms']} ms; "
          f"scheduled full GC {tick['gc_full_ms']} ms; "
          f"{tick['flips_per_tick']} flips + {tick['placements_per_tick']} placements a tick")
    api = None if args.no_api else bench_api(2.0 if args.quick else 5.0, args.api_cells)
    result = {"cells": args.cells, "sessions": args.sessions, "tick_includes_snapshot": True,
              "tick_p50_ms": tick["tick_p50_ms"], "tick_p99_ms": tick["tick_p99_ms"],
              "decisions_per_tick": tick["decisions_per_tick"], "gc_full_ms": tick["gc_full_ms"],
              "api_cells": args.api_cells if api else None,
              "api_rps_get": api["api_rps_get"] if api else None,
              "api_rps_flip": api["api_rps_flip"] if api else None}
    finish(result, args, "scheduler_scale")


if __name__ == "__main__":
    main()

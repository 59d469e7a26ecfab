"""How long does a planner tick take at 10,000 cells and 1,000,000 sessions, and how fast is
the REST API in front of it?

Planner tick = what the controller does with a fresh snapshot: wrap the per-cell summaries
in a `Snapshot`, `plan_flips`, then `choose_destinations` for every session on the cells
flipped to training. The fleet state is moved out of the cyclic GC first (`gc.freeze()`,
`--no-freeze` to measure without). Between ticks (untimed) the fleet moves: a share of the rollout cells
finish and admit sessions, the backlog of finished trajectories wanders (so the planner
flips both ways), and the last tick's decisions are applied.

REST: the real app (`scheduler.api.app.create_app`) under uvicorn on 127.0.0.1 with its SQLite
store, a bounded loop of sequential keep-alive requests from one client:
GET /v1/cells/{id} and POST /v1/flips {"count": 1}.

    python bench/scheduler_scale.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.planner.destinations import choose_destinations  # noqa: E402
from scheduler.planner.plan import plan_flips  # noqa: E402
from scheduler.planner.types import CellSummary, RequestSummary, Snapshot  # noqa: E402

CAPACITY = 128
"""Sessions per rollout cell (1,000,000 sessions on ~9,000 rollout cells)."""
BATCH = 1024
TRAIN_RATE = BATCH / (32 * 3600.0)
SLOT_RATE = TRAIN_RATE / 9 / CAPACITY
"""Per-slot finish rate that puts the balance at about 10 % training cells."""
API_CELLS = (32, 256)
"""Fleet sizes registered for the REST loop (the JSON reports the last): every GET walks
the whole cell table in the current controller, so the rate depends on the fleet."""
TOKENS_PER_SESSION = 20_000
BLOCK = 16


class Fleet:
    """Per-cell summaries the way the controller keeps them: rebuilt only where cells changed."""

    def __init__(self, cells: int, sessions: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.n = cells
        n_train = cells // 10
        self.role = ["training"] * n_train + ["rollout"] * (cells - n_train)
        self.inflight = [0] * cells
        rollout = list(range(n_train, cells))
        left = sessions
        for k, c in enumerate(rollout):  # spread sessions evenly with some jitter
            share = left // (len(rollout) - k)
            self.inflight[c] = min(CAPACITY, max(0, share + self.rng.randint(-8, 8)))
            left -= self.inflight[c]
        self.busy = [i < n_train * 8 // 10 for i in range(cells)]
        self.gen = [0] * cells
        self.summaries = [self._summary(c) for c in range(cells)]
        self.waiting = 2 * BATCH

    def _summary(self, c: int) -> CellSummary:
        inflight = self.inflight[c] if self.role[c] == "rollout" else 0
        per = TOKENS_PER_SESSION // BLOCK
        return CellSummary(c, f"node{c // 8}", self.role[c], 0, inflight, CAPACITY,
                           (CAPACITY - inflight) * per, CAPACITY * per, self.gen[c], True,
                           self.role[c] == "training" and self.busy[c], inflight * TOKENS_PER_SESSION // 2)

    def sessions(self) -> int:
        return sum(self.inflight[c] for c in range(self.n) if self.role[c] == "rollout")

    def churn(self, share: float) -> None:
        """Between ticks: `share` of rollout cells finish and admit a few sessions; the backlog
        moves by up to two batches either way."""
        for c in self.rng.sample(range(self.n), int(share * self.n)):
            if self.role[c] == "rollout":
                self.inflight[c] = min(CAPACITY, max(0, self.inflight[c] + self.rng.randint(-3, 3)))
                self.summaries[c] = self._summary(c)
        self.waiting = max(0, self.waiting + self.rng.randint(-2 * BATCH, 2 * BATCH))

    def snapshot(self) -> Snapshot:
        return Snapshot(cells=tuple(self.summaries), finished_waiting=self.waiting, batch_size=BATCH,
                        training_in_progress=True, min_rollout_cells=1, queued_sessions=0,
                        steps_in_progress=max(1, self.n // 10 // 128),
                        finish_rate_per_slot_s=SLOT_RATE, train_rate_per_cell_s=TRAIN_RATE)

    def apply(self, decisions, moves, dests) -> None:
        for d in decisions:
            c = int(d.cell_id)
            self.role[c] = "training" if d.to == "training" else "rollout"
            self.gen[c] += 1
            if d.to == "training":
                self.inflight[c], self.busy[c] = 0, False
            else:
                self.inflight[c] = 0
            self.summaries[c] = self._summary(c)
        for dest in dests:
            if dest.cell_id is not None:
                self.inflight[int(dest.cell_id)] += 1
        for c in {int(x.cell_id) for x in dests if x.cell_id is not None}:
            self.summaries[c] = self._summary(c)


def planner_tick(fleet: Fleet) -> tuple[float, int, int]:
    """One timed tick; returns (seconds, flips, placements)."""
    t0 = time.perf_counter()
    snap = fleet.snapshot()
    decisions = plan_flips(snap)
    moves = []
    for d in decisions:
        if d.to == "training":
            c = snap.cells[int(d.cell_id)]
            ctx = c.inflight_tokens // max(1, c.inflight)
            moves.extend((c.cell_id, RequestSummary(f"{c.cell_id}-{j}", ctx, c.version)) for j in range(c.inflight))
    dests = choose_destinations(snap, moves) if moves else []
    dt = time.perf_counter() - t0
    fleet.apply(decisions, moves, dests)
    return dt, len(decisions), len(dests)


def bench_planner(cells: int, sessions: int, ticks: int, seed: int, freeze: bool = True) -> dict:
    fleet = Fleet(cells, sessions, seed)
    assert abs(fleet.sessions() - sessions) <= cells, "fleet does not hold the sessions asked for"
    if freeze:
        # long-lived state leaves the cyclic GC, as a controller does once it has loaded its
        # store: otherwise a gen-2 collection walks it inside about one heavy tick in two
        gc.collect()
        gc.freeze()
    for _ in range(5):  # warm-up
        fleet.churn(0.02)
        planner_tick(fleet)
    times, flips, placed = [], [], []
    for _ in range(ticks):
        fleet.churn(0.02)
        dt, f, p = planner_tick(fleet)
        times.append(dt * 1e3)
        flips.append(f)
        placed.append(p)
    times.sort()
    return {"tick_p50_ms": round(statistics.median(times), 2),
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


def bench_api(seconds: float, n_cells: int) -> dict | None:
    """req/s of the real app for GET /v1/cells/{id} and POST /v1/flips; None if there is no app."""
    try:
        import httpx
        import uvicorn

        from scheduler.api.app import create_app
        from scheduler.contract.config import SchedulerConfig
    except ImportError as e:
        print(f"api: skipped ({e})")
        return None
    tmp = tempfile.mkdtemp(prefix="cellflip-scale-")
    port = _free_port()
    app = create_app(SchedulerConfig(port=port, db_path=f"{tmp}/scheduler.sqlite", min_rollout_cells=1,
                                     lease_s=3600.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
            for _ in range(200):
                if server.started:
                    break
                time.sleep(0.05)
            for i in range(n_cells):  # register, then a first sync puts the cell in rollout
                cid, inc = f"cell-{i}", f"inc-{i}"
                client.post("/internal/v1/cells/register", json={
                    "cell_id": cid, "incarnation": inc, "address": f"127.0.0.1:{20000 + i}",
                    "store_port": 30000 + i, "capabilities": {"kv_export": True, "block_size": 16},
                    "kv_blocks_total": 1024, "max_running": 16, "version": 0}).raise_for_status()
                client.post(f"/internal/v1/cells/{cid}/sync", json={
                    "incarnation": inc, "summary": {"inflight": 0, "kv_blocks_used": 0, "kv_blocks_total": 1024,
                                                    "version": 0, "request_ids": [], "role": "rollout"}}
                            ).raise_for_status()

            def loop(fn, limit: int) -> tuple[float, int, dict[int, int]]:
                codes: dict[int, int] = {}
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds and n < limit:
                    code = fn(n)
                    codes[code] = codes.get(code, 0) + 1
                    n += 1
                return n / (time.perf_counter() - t0), n, codes

            get_rps, n_get, get_codes = loop(
                lambda i: client.get(f"/v1/cells/cell-{i % n_cells}").status_code, 10**9)
            # each flip takes one more rollout cell (the planner picks it): stop before they run out
            flip_rps, n_flip, flip_codes = loop(lambda i: client.post(
                "/v1/flips", json={"count": 1, "to": "training"},
                headers={"Idempotency-Key": f"k-{i}"}).status_code, n_cells - 1)
        print(f"api: {n_cells} cells; GET /v1/cells/{{id}} {get_rps:.0f} req/s ({n_get} requests, status "
              f"{get_codes}); POST /v1/flips {flip_rps:.0f} req/s ({n_flip} requests, status {flip_codes})")
        return {"api_rps_get": round(get_rps, 1), "api_rps_flip": round(flip_rps, 1)}
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer ticks and a shorter API loop")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--cells", type=int, default=10_000)
    ap.add_argument("--sessions", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-api", action="store_true", help="skip the REST measurement")
    ap.add_argument("--no-freeze", action="store_true", help="leave the fleet state in the cyclic GC")
    args = ap.parse_args()
    ticks = 60 if args.quick else 300
    planner = bench_planner(args.cells, args.sessions, ticks, args.seed, freeze=not args.no_freeze)
    print(f"planner: {args.cells} cells, {args.sessions} sessions, {ticks} ticks: "
          f"p50 {planner['tick_p50_ms']} ms, p99 {planner['tick_p99_ms']} ms, max {planner['tick_max_ms']} ms; "
          f"{planner['flips_per_tick']} flips + {planner['placements_per_tick']} placements a tick")
    api = None
    if not args.no_api:
        for n in API_CELLS:  # the rate falls with the fleet: see API_CELLS
            api = bench_api(2.0 if args.quick else 5.0, n)
    result = {"cells": args.cells, "sessions": args.sessions,
              "tick_p50_ms": planner["tick_p50_ms"], "tick_p99_ms": planner["tick_p99_ms"],
              "decisions_per_tick": planner["decisions_per_tick"],
              "api_rps_get": api["api_rps_get"] if api else None,
              "api_rps_flip": api["api_rps_flip"] if api else None}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

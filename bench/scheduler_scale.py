"""How long does the control loop's whole tick take at 10,000 cells and 1,000,000 sessions, with
10 % and with 100 % of the cells changed since the previous tick, and how fast is the REST API in
front of it at 10,000 registered cells?

Tick: `Controller.tick(defer_sync=True)`, the reconcile tick whole as the running loop runs it
(bench/scale_tick.py says what it does and what the simulated fleet does between ticks):
p50/p99 over `--ticks` ticks (600 by default, `--quick` too) at each churn, once with the
scheduler's shipped GC policy stepped after each tick (`tick_p99_ms_churn_10`,
`tick_p99_ms_churn_100`: what the running loop does: frozen long-lived state, the young
generation's threshold at 50,000) and once with plain automatic GC (`..._autogc`: nothing
frozen, CPython's thresholds 700/10/10). The WAL sync that makes a tick's commits durable runs
after it off the loop's thread; how long the cells wait for it is reported apart
(`tick_sync_p99_ms_churn_10`, ...). The scheduled full collection (every 10 minutes in
production) is timed apart at the end: `gc_full_ms`.

REST: the real app (`scheduler.api.app.create_app_from_env`) under uvicorn on 127.0.0.1, in a
process of its own as deployed, with its SQLite store holding 10,000 rollout cells (as a
restarted scheduler finds them) that each synced, with its bearer token and its control loop
running; a bounded loop of sequential requests over one keep-alive connection from this
process (the standard library's HTTP client: its own cost per request is small beside the
server's, so the rate is the server's): GET /v1/cells/{id} and POST /v1/flips {"count": 1}.
Any answer but 200/202 fails the run.

Ingest: on a server of its own (started the same way, after the REST loop's), cells post syncs that carry 32 requests x 16
sampled tokens each (log-probs and versions) through the real route with the cell token, over 8
connections at once (`--ingest-connections`); the server process's CPU time per sync, the cores
10,000 cells syncing once a second would take, and the syncs a commit carried (the server's
group commit, from its /metrics) (bench/scale_ingest.py).

    python bench/scheduler_scale.py [--quick] [--json] [--ticks N] [--no-tick] [--no-api] [--ingest-connections K]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import add_target_args, finish  # noqa: E402
from scale_ingest import ACTIVE, CONNECTIONS, REQUESTS, TOKENS, Syncs, cpu_s, load, seed_requests  # noqa: E402
from scale_tick import StoreFleet, gc_full_ms, run_ticks  # noqa: E402

from scheduler.contract.config.scheduler import SchedulerConfig  # noqa: E402
from scheduler.store import Store  # noqa: E402

API_CELLS = 10_000
"""Cells registered (and synced) before the REST loop."""
CAPS = json.dumps({"kv_export": True, "block_size": 16})
CHURNS = (0.10, 1.00)


def bench_tick(cells: int, sessions: int, ticks: int, seed: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="cellflip-scale-")
    try:
        return _ticks(tmp, cells, sessions, ticks, seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ~0.6 GB of store


def _ticks(tmp: str, cells: int, sessions: int, ticks: int, seed: int) -> dict:
    t0 = time.perf_counter()
    fleet = StoreFleet(f"{tmp}/scheduler.sqlite", cells, sessions, seed)
    assert abs(fleet.sessions() - sessions) <= cells, "the store does not hold the sessions asked for"
    print(f"store: {cells} cells, {fleet.sessions()} sessions built in {time.perf_counter() - t0:.0f} s")
    out: dict = {}
    for share in CHURNS:
        for shipped in (True, False):
            r = run_ticks(fleet, share, ticks, shipped)
            key = f"churn_{round(share * 100)}" + ("" if shipped else "_autogc")
            out[key] = r
            print(f"tick (reconcile, whole): churn {share:.0%}, {'shipped GC policy' if shipped else 'automatic GC'}, "
                  f"{ticks} ticks: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, max {r['max_ms']} ms; "
                  f"{r['flips_per_tick']} flips a tick; then its WAL sync, off the loop: p50 {r['sync_p50_ms']} ms, "
                  f"p99 {r['sync_p99_ms']} ms", flush=True)
    out["gc_full_ms"] = gc_full_ms(fleet)
    fleet.ctl.ctx.tail.close()
    fleet.store.close()
    return out


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


@contextmanager
def _serving(n_cells: int, active: int):
    """The real app in a process of its own over a store of `n_cells` rollout cells (each synced
    once), `active` of them owning running requests (bench/scale_ingest.py); yields (port, the
    trainer's headers, the cell's headers, cell → its request ids, the server's pid, the scrape
    token's headers)."""
    import httpx

    from scheduler.api.httpwire import PROTOCOL
    from scheduler.contract.config import SCHEDULER_CONFIG_ENV, CellflipConfig
    from scheduler.contract.tokens import server_tokens

    tmp = tempfile.mkdtemp(prefix="cellflip-scale-")
    port = _free_port()
    cfg = SchedulerConfig(port=port, db_path=f"{tmp}/scheduler.sqlite", min_rollout_cells=1, lease_s=3600.0)
    _seed(cfg.db_path, n_cells)
    owned = seed_requests(cfg.db_path, [f"cell-{i}" for i in range(0, n_cells, max(1, n_cells // active))][:active]
                          ) if active else {}
    tokens = server_tokens(cfg)  # made here, read by the server; each client with its own scope
    headers = {"Authorization": f"Bearer {tokens['trainer']}"}
    cell_headers = {"Authorization": f"Bearer {tokens['cell']}"}
    scrape_headers = {"Authorization": f"Bearer {tokens['scrape']}"}
    env = {**os.environ, SCHEDULER_CONFIG_ENV: CellflipConfig(scheduler=cfg).model_dump_json(),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "scheduler.api.app:create_app_from_env",
                               "--host", "127.0.0.1", "--port", str(port), "--http", PROTOCOL, "--log-level", "warning",
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
        yield port, headers, cell_headers, owned, server.pid, scrape_headers
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_api(seconds: float, n_cells: int, conns: int = CONNECTIONS) -> dict | None:
    """req/s of the real app for GET /v1/cells/{id} and POST /v1/flips at `n_cells` registered
    cells (with its bearer token, as deployed), then (on a server of its own: the flips left
    under way would load it) the ingest's CPU per sync; None if there is no app. The server runs
    in a process of its own (as deployed): the client's own cost is not the server's."""
    try:
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"api: skipped ({e})")
        return None
    with _serving(n_cells, 0) as (port, headers, _, _, _, _):
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
    with _serving(n_cells, ACTIVE) as (port, _, cell_headers, owned, pid, scrape_headers):
        ingest = bench_ingest(port, cell_headers, owned, seconds, pid, conns)
        ingest["ingest_syncs_per_commit"] = _syncs_per_commit(port, scrape_headers)
    return {"api_rps_get": round(get_rps, 1), "api_rps_flip": round(flip_rps, 1), **ingest}


def _syncs_per_commit(port: int, headers: dict) -> float | None:
    """Syncs a token transaction carried on average, from the server's /metrics (group commit)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=30.0).text
    got = {k: float(v) for k, _, v in (line.partition(" ") for line in text.splitlines())
           if k in ("cellflip_ingest_commits_total", "cellflip_ingest_syncs_total")}
    commits = got.get("cellflip_ingest_commits_total", 0.0)
    return round(got.get("cellflip_ingest_syncs_total", 0.0) / commits, 2) if commits else None


def bench_ingest(port: int, cell_headers: dict, owned: dict, seconds: float, pid: int, conns: int) -> dict:
    """Server CPU per token-carrying sync (bench/scale_ingest.py), after an idle window as long."""
    c0 = cpu_s(pid)
    time.sleep(seconds)
    idle = (cpu_s(pid) - c0) / seconds
    r = load(port, cell_headers, Syncs(owned), seconds, pid, conns)
    per_sync = r["cpu_s"] / max(1, r["syncs"])
    print(f"ingest: {r['syncs']} syncs of {REQUESTS} x {TOKENS} tokens from {len(owned)} cells over {conns} "
          f"connections in {r['wall_s']:.1f} s "
          f"({r['syncs'] / r['wall_s']:.0f}/s); server CPU {r['cpu_s']:.2f} s = {per_sync * 1e3:.2f} ms a sync "
          f"(idle: {idle * 1e3:.0f} ms a second); 10,000 cells at 1 Hz need {per_sync * 10_000:.1f} cores")
    return {"ingest_syncs": r["syncs"], "ingest_server_cpu_ms_per_sync": round(per_sync * 1e3, 3),
            "idle_server_cpu_ms_per_s": round(idle * 1e3, 1),
            "cores_for_10k_cells_at_1hz": round(per_sync * 10_000, 2),
            "ingest_tokens_per_sync": REQUESTS * TOKENS, "ingest_connections": conns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter API loop")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--cells", type=int, default=10_000)
    ap.add_argument("--sessions", type=int, default=1_000_000)
    ap.add_argument("--ticks", type=int, default=600, help="timed ticks at each churn and GC mode")
    ap.add_argument("--api-cells", type=int, default=API_CELLS, help="cells registered for the REST loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-api", action="store_true", help="skip the REST and ingest measurements")
    ap.add_argument("--ingest-connections", type=int, default=CONNECTIONS,
                    help="connections posting syncs at once in the ingest measurement (1: one at a time)")
    ap.add_argument("--no-tick", action="store_true", help="skip the tick measurement")
    add_target_args(ap)
    args = ap.parse_args()
    tick = {"gc_full_ms": None} if args.no_tick else bench_tick(args.cells, args.sessions, args.ticks, args.seed)
    print(f"scheduled full GC {tick['gc_full_ms']} ms")
    api = None if args.no_api else bench_api(2.0 if args.quick else 5.0, args.api_cells, args.ingest_connections)
    result = {"cells": args.cells, "sessions": args.sessions, "tick_scope": "reconcile", "ticks": args.ticks,
              "gc_full_ms": tick["gc_full_ms"]}
    for key, r in tick.items():
        if isinstance(r, dict):
            result[f"tick_p50_ms_{key}"], result[f"tick_p99_ms_{key}"] = r["p50_ms"], r["p99_ms"]
            result[f"flips_per_tick_{key}"] = r["flips_per_tick"]
            result[f"tick_sync_p99_ms_{key}"] = r["sync_p99_ms"]
    for k in ("ingest_server_cpu_ms_per_sync", "cores_for_10k_cells_at_1hz", "idle_server_cpu_ms_per_s",
              "ingest_syncs", "ingest_tokens_per_sync", "ingest_connections", "ingest_syncs_per_commit"):
        result[k] = api[k] if api else None
    result.update({"api_cells": args.api_cells if api else None,
                   "api_rps_get": api["api_rps_get"] if api else None,
                   "api_rps_flip": api["api_rps_flip"] if api else None})
    finish(result, args, "scheduler_scale")


if __name__ == "__main__":
    main()

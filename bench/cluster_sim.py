"""How much trained throughput does flipping cells buy over sync and static splits?

Discrete-event simulation of N cells and their sessions (bench/sim/); every flip and
placement decision of `flip_abort` and `cellflip` is `scheduler.planner`'s, unchanged.
Policies on the same workload and seed: sync, static (rollout share swept 0.50..0.95 and the
best reported: a hindsight tuning no operator has), flip_abort, cellflip.

    python bench/cluster_sim.py [--quick] [--json] [--plots [DIR]] [--workload PATH ...]

--quick: 1,000 cells; default 10,000. Last stdout line with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from sim import BUILTIN, RunResult, load_workload, make_policy, run_policy  # noqa: E402
from sim.workload import Workload  # noqa: E402

POLICIES = ("sync", "static", "flip_abort", "cellflip")
STATIC_SWEEP = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
"""Rollout shares tried for `static` (0.50 .. 0.95)."""


def simulate_workload(wl: Workload, cells: int, hours: float, seed: int, tick_s: float,
                      log=print) -> tuple[dict, list[RunResult]]:
    """Run every policy on one workload; returns its JSON block and the runs to plot."""
    def run(name: str, frac: float = 0.0) -> RunResult:
        r = run_policy(wl, make_policy(name, frac), cells, hours, seed=seed, tick_s=tick_s)
        return r

    sync = run("sync")
    sweep = {f: run("static", f) for f in STATIC_SWEEP}
    best_f = max(sweep, key=lambda f: sweep[f].trained_tokens_per_hour)
    static = sweep[best_f]
    static.policy = "static"
    flip_abort = run("flip_abort")
    cellflip = run("cellflip")
    runs = [sync, static, flip_abort, cellflip]

    log("  static sweep (rollout share -> trained Mtok/h): " + ", ".join(
        f"{f:.2f}:{sweep[f].trained_tokens_per_hour / 1e6:.1f}" for f in STATIC_SWEEP))
    log(f"  {'policy':<11}{'util':>7}{'Mtok/h':>9}{'sess/h':>9}{'recomp Mtok':>12}{'dropped':>9}"
        f"{'stale mean':>11}{'p50/p90/p99/max':>17}{'lost cell-h':>12}{'kv/repf/susp':>20}{'flips':>7}{'wall s':>8}")
    for r in runs:
        q = r.staleness_quantiles()
        qs = "/".join(str(q.get(k, 0)) for k in ("p50", "p90", "p99", "max"))
        mv = f"{r.moves['kv']}/{r.moves['reprefill']}/{r.moves['suspend']}"
        log(f"  {r.policy:<11}{r.utilization:>7.3f}{r.trained_tokens_per_hour / 1e6:>9.1f}"
            f"{r.trained_sessions / hours:>9.0f}{r.recomputed_tokens / 1e6:>12.1f}{r.dropped_sessions:>9}"
            f"{r.mean_staleness:>11.2f}{qs:>17}{r.lost_work_cell_hours:>12.1f}{mv:>20}{r.flips:>7}{r.wall_s:>8.1f}")
    for r in runs:
        s = r.series
        n = len(s["t_h"])
        marks = [i for i in (n // 6, n // 3, n // 2, 2 * n // 3, 5 * n // 6, n - 1) if 0 <= i < n]
        log(f"  {r.policy:<11}roles over time (h: rollout/training cells, decoding+training busy share): " + "  ".join(
            f"{s['t_h'][i]:.0f}h:{s['rollout_cells'][i]:.0f}/{s['training_cells'][i]:.0f},"
            f"{(s['decoding'][i] + s['training_busy'][i]) / cells:.2f}" for i in marks))

    def ratio(other: RunResult) -> float:
        o = other.trained_tokens_per_hour
        return round(cellflip.trained_tokens_per_hour / o, 3) if o > 0 else float("inf")

    block = {
        "policies": {name: r.metrics() for name, r in zip(POLICIES, runs)},
        "static_best_rollout_fraction": best_f,
        "speedup_vs_sync": ratio(sync),
        "speedup_vs_static": ratio(static),
        "speedup_vs_flip_abort": ratio(flip_abort),
    }
    return block, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 cells instead of 10,000")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--cells", type=int, default=None, help="override the cell count")
    ap.add_argument("--hours", type=float, default=72.0, help="simulated hours (default 72)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tick-s", type=float, default=60.0, help="controller tick (simulated seconds)")
    ap.add_argument("--workload", action="append", default=[],
                    help="extra workload YAML (schema: bench/sim/workload.py); repeatable")
    ap.add_argument("--plots", nargs="?", const=str(HERE / "out"), default=None,
                    help="write PNG plots to DIR (default bench/out/)")
    args = ap.parse_args()
    cells = args.cells or (1_000 if args.quick else 10_000)
    t0 = time.perf_counter()
    result: dict = {"cells": cells, "hours": args.hours, "workloads": {}}
    print(f"cluster_sim: {cells} cells, {args.hours:g} h, seed {args.seed}, tick {args.tick_s:g} s")
    for name in (*BUILTIN, *args.workload):
        wl = load_workload(name)
        print(f"workload {wl.describe()}")
        block, runs = simulate_workload(wl, cells, args.hours, args.seed, args.tick_s)
        result["workloads"][wl.name] = block
        print(f"  speedup of cellflip: vs sync {block['speedup_vs_sync']}, vs static "
              f"{block['speedup_vs_static']} (best static rollout share "
              f"{block['static_best_rollout_fraction']}), vs flip_abort {block['speedup_vs_flip_abort']}")
        if args.plots:
            from sim.plots import plot_workload

            for path in plot_workload(wl.name, runs, Path(args.plots), wl.session_tokens):
                print(f"  wrote {os.path.relpath(path)}")
    print(f"total wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

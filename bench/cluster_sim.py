"""How much trained throughput does flipping cells buy over the baselines a user would pick?

Discrete-event simulation of N cells and their sessions (bench/sim/); every flip and
placement decision of `flip_abort`, `flip_reprefill` and `cellflip` is `scheduler.planner.plan`'s,
unchanged, on a `Snapshot` measured by the controller's own `scheduler.control.rates`. Policies on
the same workload: sync (verl-like rounds with a users' timeout; sync_p99 beside it, and
sync_same_batch: rounds of the asynchronous batch), static (its rollout share chosen on seed 0
over 0.00..1.00, a 0.05 sweep refined by 0.01), flip_abort, flip_reprefill, cellflip, and a free
oracle (a hand-tuned controller with free moves, not a ceiling). Every policy is reported as the
mean over seeds 1..3, against `upper_bound` (bench/sim/bound.py: a certified LP relaxation with
admission timing as a decision); every run of every seed is asserted at most the bound.

`speedup_vs_flip_reprefill` is paired (`sim.run.run_paired`): per seed, cellflip over its twin
that replays cellflip's flips tick by tick with a re-prefill for every move, and flip_reprefill's
twin that replays flip_reprefill's flips with a live KV copy over flip_reprefill; the mean of
both ratios over the seeds. A pair shares its seed (the same sessions in the same order: each
admission's slot time is the next draw of the seed's stream, common random numbers) and its
roles at every tick, so it differs by how moved sessions travel only: a real loss of live KV
migration shows, and the noise of two runs parting ways after their first move does not (the
ratio of unpaired means is kept as `speedup_vs_flip_reprefill_own_flips`).

    python bench/cluster_sim.py [--quick] [--json] [--jobs N] [--plots [DIR]] [--workload NAME_OR_PATH ...]
    python bench/cluster_sim.py --rl-jobs [--quick] [--json] [--workload NAME ...]

--rl-jobs: several RL jobs on one fleet (bench/sim/jobbench.py): 1,000 cells, 48 h; cellflip
dividing the fleet between jobs against the best static partition and the multi-job bound
(`job_workloads`; goals in bench/targets.yaml under cluster_sim.rl_jobs). --quick: seed 1 and a
coarser static grid; default seeds 1..3.

--quick: 1,000 cells; default 10,000. Last stdout line with --json: one JSON object.
--jobs N: runs in N worker processes (this file with `--serve`: one task per JSON line on
stdin, one result per JSON line on stdout; nothing pickled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from common import add_target_args, finish  # noqa: E402
from sim import BUILTIN, POLICIES, RunResult, load_workload, make_policy, run_policy  # noqa: E402
from sim.bound import upper_bound, warmup_s  # noqa: E402
from sim.fluid import rebalance_gain  # noqa: E402
from sim.policies import ORACLE_SOURCES  # noqa: E402
from sim.run import PAIRED_MODES, run_paired  # noqa: E402
from sim.workload import Workload  # noqa: E402

COARSE = tuple(round(0.05 * i, 2) for i in range(21))
"""Rollout shares tried for `static` first (0.00 .. 1.00)."""
SEEDS = (1, 2, 3)
"""Seeds every policy is reported over (the static share is chosen on seed 0)."""
NUMERIC = ("trained_tokens_per_hour", "utilization", "goodput_utilization", "dropped_fraction",
           "recomputed_tokens", "mean_staleness", "versions")


def _run(args: tuple) -> list[RunResult]:
    """One task of a pool worker: (workload, policy, static share, cells, hours, seed) -> its
    run; `cellflip` and `flip_reprefill` also their paired twin (`sim.run.run_paired`)."""
    wl, policy, share, cells, hours, seed = args
    if policy == "oracle":  # the ceiling: the better of the oracle's free strategies
        runs = [run_policy(wl, make_policy(f"oracle:{s}"), cells, hours, seed=seed) for s in ORACLE_SOURCES]
        return [max(runs, key=lambda r: r.trained_tokens_per_hour)]
    if policy in PAIRED_MODES:
        return list(run_paired(wl, policy, cells, hours, seed=seed))
    return [run_policy(wl, make_policy(policy, share), cells, hours, seed=seed)]


class Workers:
    """`jobs` processes running this file with `--serve`, each taking the next task as soon as
    it is free. Tasks and results travel as JSON lines."""

    def __init__(self, jobs: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env) for _ in range(jobs)]

    def map(self, tasks: list[tuple]) -> list[list[RunResult]]:
        todo: queue.Queue = queue.Queue()
        for i in range(len(tasks)):
            todo.put(i)
        out: list[list[RunResult] | None] = [None] * len(tasks)
        errors: list[str] = []

        def feed(p: subprocess.Popen) -> None:
            while not errors:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                wl, policy, share, cells, hours, seed = tasks[i]
                p.stdin.write(json.dumps({"workload": wl.model_dump(), "policy": policy, "share": share,
                                          "cells": cells, "hours": hours, "seed": seed}) + "\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line.startswith("RESULT "):
                    errors.append(f"worker {p.pid} exited (code {p.poll()}) on task {tasks[i][1:]}")
                    return
                out[i] = [RunResult(**r) for r in json.loads(line[len("RESULT "):])]

        threads = [threading.Thread(target=feed, args=(p,), daemon=True) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(errors[0])
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


def _serve() -> None:
    """A worker: one JSON task per stdin line -> one `RESULT [RunResult, ...]` line on stdout."""
    for line in sys.stdin:
        a = json.loads(line)
        rs = _run((Workload.model_validate(a["workload"]), a["policy"], a["share"], a["cells"], a["hours"],
                   a["seed"]))
        print("RESULT " + json.dumps([dataclasses.asdict(r) for r in rs], default=lambda x: x.item()), flush=True)


def _map(tasks: list[tuple], pool: Workers | None) -> list[list[RunResult]]:
    return pool.map(tasks) if pool is not None else [_run(t) for t in tasks]


def choose_static_share(wl: Workload, cells: int, hours: float, log=print, pool=None) -> tuple[float, dict[float, float]]:
    """The rollout share of the best static split on seed 0: a 0.05 sweep, refined by 0.01."""
    def sweep(shares: list[float]) -> dict[float, float]:
        runs = _map([(wl, "static", f, cells, hours, 0) for f in shares], pool)
        return {f: r[0].trained_tokens_per_hour for f, r in zip(shares, runs)}

    seen = sweep(list(COARSE))
    best = max(seen, key=seen.__getitem__)
    seen |= sweep([f for f in (round(best + 0.01 * i, 2) for i in range(-4, 5))
                   if 0.0 <= f <= 1.0 and f not in seen])
    best = max(seen, key=seen.__getitem__)
    log("  static sweep, seed 0 (rollout share -> trained Mtok/h): " + ", ".join(
        f"{f:.2f}:{seen[f] / 1e6:.1f}" for f in sorted(seen)))
    return best, seen


def paired_ratios(runs: dict[str, list[RunResult]]) -> dict:
    """Per seed, cellflip over re-prefill on the same flips, both ways: on cellflip's flips
    (`cellflip` / `cellflip@reprefill`) and on flip_reprefill's (`flip_reprefill@kv` /
    `flip_reprefill`). Each pair shares its seed's sessions and its roles at every tick. Both
    ways, because flips decided on a run's own measurements suit that run a little better than
    its twin (on `sinusoidal` +0.3 % for whichever leads, seed after seed): the mean of the
    two ways cancels that home advantage and leaves the moves' cost."""
    def ratio(a: RunResult, b: RunResult) -> float:
        return a.trained_tokens_per_hour / b.trained_tokens_per_hour if b.trained_tokens_per_hour > 0 else float("inf")

    on_cf = [ratio(a, b) for a, b in zip(runs["cellflip"], runs["cellflip@reprefill"])]
    on_rp = [ratio(a, b) for a, b in zip(runs["flip_reprefill@kv"], runs["flip_reprefill"])]
    both = on_cf + on_rp
    return {"on_cellflip_flips": [round(x, 5) for x in on_cf], "on_reprefill_flips": [round(x, 5) for x in on_rp],
            "mean": round(sum(both) / len(both), 5)}


def paired_speedup(runs: dict[str, list[RunResult]]) -> float:
    """The mean of the paired ratios (`paired_ratios`), both ways, over the seeds (3 decimals,
    as every speedup of the block; the block's `vs_flip_reprefill_paired.mean` keeps 5)."""
    return round(paired_ratios(runs)["mean"], 3)


def check_bound(wl: Workload, cells: int, hours: float, bound: float, runs: dict[str, list[RunResult]],
                sweep: dict[float, float]) -> None:
    """Every run of every policy on every seed (the static sweep's too) at most the bound. A
    sync trainer spans the fleet, wider than the bound's step: a sync run above the bound is
    held to the bound at the fleet's width instead."""
    fleet: float | None = None
    for p, rs in runs.items():
        for seed, r in zip(SEEDS, rs):
            top = bound
            if r.trained_tokens_per_hour > bound and p.startswith("sync"):
                fleet = fleet or upper_bound(wl, cells, hours, width=cells).tokens_per_hour
                top = fleet
            assert r.trained_tokens_per_hour <= top, (
                f"{wl.name}: {p} seed {seed} ({r.trained_tokens_per_hour:.0f}) above the upper bound ({top:.0f})")
    for f, v in sweep.items():
        assert v <= bound, f"{wl.name}: static {f} seed 0 ({v:.0f}) above the upper bound ({bound:.0f})"


def simulate_workload(wl: Workload, cells: int, hours: float, log=print, pool=None) -> tuple[dict, list[RunResult]]:
    """Every policy on one workload, mean over `SEEDS`; returns its JSON block and seed 1's runs."""
    share, sweep = choose_static_share(wl, cells, hours, log, pool)
    tasks = [(wl, p, share, cells, hours, seed) for seed in SEEDS for p in POLICIES]
    runs: dict[str, list[RunResult]] = {p: [] for p in POLICIES}
    for rs in _map(tasks, pool):
        for r in rs:
            runs.setdefault(r.policy, []).append(r)
    bound = upper_bound(wl, cells, hours)
    log(f"  upper bound {bound.tokens_per_hour / 1e6:.2f} Mtok/h (LP: {bound.buckets} buckets, "
        f"{bound.cohorts} admission ticks, certified within {bound.gap:.1e} of its best plan)")
    check_bound(wl, cells, hours, bound.tokens_per_hour, runs, sweep)
    mean = {p: {k: sum(r.metrics()[k] for r in rs) / len(rs) for k in NUMERIC} for p, rs in runs.items()}

    log(f"  {'policy':<15}{'util':>7}{'goodput':>8}{'Mtok/h':>9}{'dropped':>9}{'recomp Mtok':>12}"
        f"{'stale':>7}{'p50/p90/p99/max':>17}{'versions':>9}{'kv/repf/abort/susp':>26}{'flips':>7}{'wall s':>8}")
    for p, rs in runs.items():
        m, r = mean[p], rs[0]
        q = r.staleness_quantiles()
        qs = "/".join(str(q.get(k, 0)) for k in ("p50", "p90", "p99", "max"))
        mv = "/".join(str(r.moves[k]) for k in ("kv", "reprefill", "abort", "suspend"))
        log(f"  {p:<15}{m['utilization']:>7.3f}{m['goodput_utilization']:>8.3f}"
            f"{m['trained_tokens_per_hour'] / 1e6:>9.2f}{m['dropped_fraction']:>9.3f}"
            f"{m['recomputed_tokens'] / 1e6:>12.1f}{m['mean_staleness']:>7.1f}{qs:>17}{m['versions']:>9.0f}"
            f"{mv:>26}{r.flips:>7}{sum(x.wall_s for x in rs):>8.1f}")

    cf = mean["cellflip"]["trained_tokens_per_hour"]

    def speedup(p: str) -> float:
        o = mean[p]["trained_tokens_per_hour"]
        return round(cf / o, 3) if o > 0 else float("inf")

    oracle = mean["oracle"]["trained_tokens_per_hour"]
    top = bound.tokens_per_hour
    block = {
        "policies": {p: {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}
                     for p, m in mean.items()},
        "goodput_utilization": round(mean["cellflip"]["goodput_utilization"], 4),
        "dropped_fraction": round(mean["cellflip"]["dropped_fraction"], 4),
        "oracle_throughput": round(oracle, 1),
        "static_rollout_share": share,
        "speedup_vs_sync": speedup("sync"),
        "speedup_vs_sync_p99": speedup("sync_p99"),
        "speedup_vs_sync_same_batch": speedup("sync_same_batch"),
        "speedup_vs_static": speedup("static"),
        "speedup_vs_flip_abort": speedup("flip_abort"),
        "speedup_vs_flip_reprefill": paired_speedup(runs),
        "speedup_vs_flip_reprefill_own_flips": speedup("flip_reprefill"),
        "vs_flip_reprefill_paired": paired_ratios(runs),
        "oracle_fraction": round(cf / oracle, 4) if oracle > 0 else 0.0,
        "upper_bound": round(top, 1),
        "bound_fraction": round(cf / top, 4),
        "oracle_bound_fraction": round(oracle / top, 4),
        "static_bound_fraction": round(mean["static"]["trained_tokens_per_hour"] / top, 4),
        "bound_over_static": round(top / mean["static"]["trained_tokens_per_hour"], 4)
        if mean["static"]["trained_tokens_per_hour"] > 0 else None,
        "bound_first_step_h": round(warmup_s(wl, cells, hours * 3600.0) / 3600.0, 3),
        "bound_gap": float(f"{bound.gap:.2e}"),
        "rebalance_gain": round(rebalance_gain(wl, cells, hours), 4),
        "underfilled": wl.underfilled is not None,
        "batch_size": wl.batch_for(cells)[0],
        "seeds": list(SEEDS),
    }
    return block, [rs[0] for p, rs in runs.items() if p in POLICIES]


def markdown(result: dict) -> str:
    """The README table: every workload, every policy's trained Mtok/h, the bound, and the ratios."""
    cols = ("sync", "sync_p99", "sync_same_batch", "static", "flip_abort", "flip_reprefill", "cellflip", "oracle")
    lines = ["| workload | " + " | ".join(cols) + " | bound | vs sync | vs sync same batch | vs static "
             "| vs abort | vs reprefill | bound frac | oracle bound frac | dropped | goodput |",
             "|---" * (len(cols) + 11) + "|"]
    for name, b in result["workloads"].items():
        pol = b["policies"]
        lines.append(f"| {name} | " + " | ".join(f"{pol[c]['trained_tokens_per_hour'] / 1e6:.1f}" for c in cols)
                     + f" | {b['upper_bound'] / 1e6:.1f} | {b['speedup_vs_sync']:.2f} | "
                       f"{b['speedup_vs_sync_same_batch']:.1f} | {b['speedup_vs_static']:.3f} | "
                       f"{b['speedup_vs_flip_abort']:.3f} | {b['speedup_vs_flip_reprefill']:.3f} | "
                       f"{b['bound_fraction']:.3f} | {b['oracle_bound_fraction']:.3f} | "
                       f"{b['dropped_fraction']:.3f} | {b['goodput_utilization']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 cells instead of 10,000")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--cells", type=int, default=None, help="override the cell count")
    ap.add_argument("--hours", type=float, default=None,
                    help="simulated hours (default: the workload's, else 72)")
    ap.add_argument("--workload", action="append", default=[],
                    help="workload name or YAML path (schema: bench/sim/workload.py); repeatable; "
                         "default: every committed one")
    ap.add_argument("--plots", nargs="?", const=str(HERE / "out"), default=None,
                    help="write PNG plots (seed 1) to DIR (default bench/out/)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes; default 1)")
    ap.add_argument("--rl-jobs", action="store_true",
                    help="several RL jobs sharing the fleet (job_workloads; --workload names them)")
    add_target_args(ap)
    args = ap.parse_args()
    if args.rl_jobs:
        from sim.jobbench import run_all

        result = run_all(args.workload, args.cells or 1_000, args.hours or 48.0, args.quick)
        finish(result, args, "cluster_sim")
        return
    cells = args.cells or (1_000 if args.quick else 10_000)
    t0 = time.perf_counter()
    result: dict = {"cells": cells, "workloads": {}}
    print(f"cluster_sim: {cells} cells, seeds {SEEDS} (static share on seed 0)")
    pool = Workers(args.jobs) if args.jobs > 1 else None
    for name in args.workload or BUILTIN:
        wl = load_workload(name)
        hours = args.hours or wl.hours or 72.0
        batch, width = wl.batch_for(cells)
        print(f"workload {wl.describe()}; {hours:g} h, tick {wl.tick_s:g} s; "
              f"at {cells} cells: step {batch} sessions on <= {width} cells", flush=True)
        block, runs = simulate_workload(wl, cells, hours, pool=pool)
        block["hours"] = hours
        result["workloads"][wl.name] = block
        print(f"  block {json.dumps({wl.name: block})}", flush=True)
        print(f"  cellflip: vs sync {block['speedup_vs_sync']} (sync_p99 {block['speedup_vs_sync_p99']}), "
              f"vs static {block['speedup_vs_static']} (share {block['static_rollout_share']}), "
              f"vs flip_abort {block['speedup_vs_flip_abort']}, vs flip_reprefill "
              f"{block['speedup_vs_flip_reprefill']}, oracle fraction {block['oracle_fraction']}, "
              f"bound fraction {block['bound_fraction']} (oracle {block['oracle_bound_fraction']}, static "
              f"{block['static_bound_fraction']}), vs sync same batch {block['speedup_vs_sync_same_batch']}, "
              f"rebalance gain {block['rebalance_gain']}", flush=True)
        if args.plots:
            from sim.plots import plot_workload

            for path in plot_workload(wl.name, runs, Path(args.plots), wl.session_tokens):
                print(f"  wrote {path}")
    if pool is not None:
        pool.close()
    print(f"total wall {time.perf_counter() - t0:.0f} s")
    print(markdown(result))
    finish(result, args, "cluster_sim")


if __name__ == "__main__":
    _serve() if sys.argv[1:2] == ["--serve"] else main()

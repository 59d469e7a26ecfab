"""`bench/cluster_sim.py --rl-jobs`: several RL jobs on one fleet, cellflip against the best
static partition between the jobs and against the multi-job upper bound.

One line per workload: the static grid (each job alone at each cell count, seed 0; a split
is the sum of its jobs' runs) -> its best split and cellflip on the report's seeds -> the
multi-job bound (bench/sim/jobs_bound.py), asserted above every run, the grid's included ->
speedup, gain capture, minimum-share violations, cross-job moves, fairness.
"""

from __future__ import annotations

import itertools
import json
import time

from .bound import first_step_s
from .jobrun import JobsRun, run_jobs
from .jobs import JOB_WORKLOADS, Job, JobsWorkload
from .jobs_bound import jobs_upper_bound

GAIN_EPS = 0.01
"""No gain is possible where the bound is within this share of the best static split's trained
tokens (the issue's definition). Reported beside it: whether the bound clears the static split's
own relaxation (`static_split_bound`: the same LP, each job held to its cells of the split) by as
much, which discounts the per-job slack no policy captures (batches, staleness, warm-up)."""


def _levels(job: Job, cells: int, step: int, around: int | None = None) -> list[int]:
    lo, hi = job.min_cells, min(job.max_cells, cells)
    if around is None:
        pts = set(range(lo - lo % step + step if lo % step else lo, hi + 1, step)) | {lo}
    else:
        pts = {around + step * i for i in range(-2, 3)}
    return sorted(p for p in pts if lo <= p <= hi)


def static_grid(jw: JobsWorkload, cells: int, hours: float, coarse: int, fine: int,
                log=print) -> tuple[dict[str, int], float, dict]:
    """The best fixed split on seed 0: every split of the coarse grid (mins and maxes kept, every
    cell given to a job), then the fine grid around the best; returns (split, Mtok/h, tried)."""
    jobs = [Job(s, jw, cells) for s in jw.jobs]
    cache: dict[tuple[str, int], float] = {}

    def tokens(job: Job, n: int) -> float:
        if (job.name, n) not in cache:
            cache[job.name, n] = run_jobs(jw, cells, hours, seed=0, split={job.name: n}).trained_tokens_per_hour
        return cache[job.name, n]

    tried: dict[tuple[int, ...], float] = {}

    def sweep(levels: list[list[int]]) -> None:
        for head in itertools.product(*levels[:-1]):
            last = cells - sum(head)
            if not jobs[-1].min_cells <= last <= min(jobs[-1].max_cells, cells):
                continue
            split = (*head, last)
            if split not in tried:
                tried[split] = sum(tokens(j, n) for j, n in zip(jobs, split))

    sweep([_levels(j, cells, coarse) for j in jobs])
    best = max(tried, key=tried.__getitem__)
    sweep([_levels(j, cells, fine, around=n) for j, n in zip(jobs, best)])
    best = max(tried, key=tried.__getitem__)
    log(f"  static grid, seed 0: {len(tried)} splits from {len(cache)} per-job runs; best "
        f"{dict(zip((j.name for j in jobs), best))} at {tried[best] / 1e6:.2f} Mtok/h")
    return dict(zip((j.name for j in jobs), best)), tried[best], tried


def _mean(runs: list[JobsRun], key: str) -> float:
    return sum(getattr(r, key) for r in runs) / len(runs)


def simulate_jobs_workload(jw: JobsWorkload, cells: int, hours: float, seeds: tuple[int, ...],
                           coarse: int, fine: int, log=print) -> dict:
    """One workload's JSON block (module docstring)."""
    split, static0, tried = static_grid(jw, cells, hours, coarse, fine, log)
    cf = [run_jobs(jw, cells, hours, seed=s) for s in seeds]
    st = [run_jobs(jw, cells, hours, seed=s, split=split) for s in seeds]
    bound = jobs_upper_bound([Job(s, jw, cells) for s in jw.jobs], cells, hours)
    top = bound.tokens_per_hour
    for r in (*cf, *st):
        assert r.trained_tokens_per_hour <= top, f"{jw.name}: {r.policy} ({r.trained_tokens_per_hour:.0f}) above the bound ({top:.0f})"
    for sp, v in tried.items():
        assert v <= top, f"{jw.name}: static {sp} seed 0 ({v:.0f}) above the bound ({top:.0f})"
    c, s = _mean(cf, "trained_tokens_per_hour"), _mean(st, "trained_tokens_per_hour")
    # the same relaxation held to the static split (each job alone on its cells): what moving
    # cells could add in the relaxation, without the per-job slack no policy captures
    jobs = {j.name: j for j in (Job(x, jw, cells) for x in jw.jobs)}
    fixed = sum(jobs_upper_bound([jobs[n]], c_n, hours).tokens_per_hour for n, c_n in split.items() if c_n > 0)
    assert fixed <= top * (1.0 + 1e-6), f"{jw.name}: the static split's relaxation above the free one"
    possible = top > s * (1.0 + GAIN_EPS)
    jain = [r.jain_fairness for r in cf if r.jain_fairness is not None]
    log(f"  cellflip {c / 1e6:.2f} Mtok/h, best static {s / 1e6:.2f} (split {split}), bound {top / 1e6:.2f} "
        f"(certified within {bound.gap:.1e}); cross-job moves {cf[0].cross_job_moves} (seed {seeds[0]}), "
        f"wall {sum(r.wall_s for r in cf):.0f} s")
    return {
        "speedup_vs_static_partition": round(c / s, 4) if s > 0 else None,
        "upper_bound": round(top, 1),
        "gain_capture": round((c - s) / (top - s), 4) if possible else None,
        "gain_possible": bool(possible),
        "static_split_bound": round(fixed, 1),
        "gain_possible_over_split_bound": bool(top > fixed * (1.0 + GAIN_EPS)),
        "min_share_violation_s": max(r.min_share_violation_s for r in cf),
        "cross_job_moves": round(_mean(cf, "cross_job_moves"), 1),
        "jain_fairness": round(sum(jain) / len(jain), 4) if jain else None,
        "saturated_h": round(_mean(cf, "saturated_s") / 3600.0, 2),
        "cellflip_tokens_per_hour": round(c, 1),
        "static_tokens_per_hour": round(s, 1),
        "static_split": split,
        "static_min_share_violation_s": max(r.min_share_violation_s for r in st),
        "bound_fraction": round(c / top, 4),
        "static_bound_fraction": round(s / top, 4),
        "bound_gap": float(f"{bound.gap:.2e}"),
        "bound_first_step_h": {n: round((j.start_s + first_step_s(j.wl, cells, j.batch, hours * 3600.0, j.start_s,
                                                                  j.cumulative)) / 3600.0, 3) for n, j in jobs.items()},
        "per_job": {n: {k: round(sum(r.per_job[n][k] for r in cf) / len(cf), 4) for k in cf[0].per_job[n]}
                    for n in cf[0].per_job},
        "static_per_job": {n: {k: round(sum(r.per_job[n][k] for r in st) / len(st), 4) for k in st[0].per_job[n]}
                           for n in st[0].per_job},
        "seeds": list(seeds),
    }


def run_all(names: list[str], cells: int, hours: float, quick: bool, log=print) -> dict:
    """Every named workload (default all three): the bench's `job_workloads` result."""
    seeds = (1,) if quick else (1, 2, 3)
    coarse, fine = (100, 20) if quick else (50, 10)
    t0 = time.perf_counter()
    out: dict = {"cells": cells, "hours": hours, "seeds": list(seeds), "grid_cells": [coarse, fine],
                 "job_workloads": {}}
    for name in names or list(JOB_WORKLOADS):
        if name not in JOB_WORKLOADS:
            raise SystemExit(f"unknown --rl-jobs workload {name!r}; choose from {', '.join(JOB_WORKLOADS)}")
        jw = JOB_WORKLOADS[name]
        log(f"jobs workload {name}: " + "; ".join(
            f"{s.name}: {s.workload}, demand {s.demand_frac:g} of the fleet, min {s.min_frac:g}, weight {s.weight:g}"
            + (f", sine +-{s.sine_amplitude:g} / {s.sine_period_h:g} h" if s.sine_amplitude else "")
            + (f", {s.start_h:g}-{s.end_h:g} h" if s.end_h is not None or s.start_h else "") for s in jw.jobs), flush=True)
        block = simulate_jobs_workload(jw, cells, hours, seeds, coarse, fine, log)
        out["job_workloads"][name] = block
        log(f"  block {json.dumps({name: block})}", flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out

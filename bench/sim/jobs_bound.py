"""`jobs_upper_bound`: trained tokens per hour no policy can beat with several jobs on one fleet.

The single-job relaxation of bench/sim/bound.py, one block per job, the blocks sharing the
fleet: in every bucket the jobs' rollout slots (time-averaged occupancy of their admitted
sessions) plus their training cells fit N cells. What it frees on top of the single-job
relaxation: cells move between jobs at no cost and at once (no drain, no weight load, no
hysteresis), with perfect knowledge of every job's arrivals. What it keeps: each job's sessions
arrive as they do in the simulator (the same deterministic arrivals; admissions at a tick
are at most that tick's arrivals, the rest are lost), each job's own session lengths, its own
training cost and step width (its g(c) = c x eff(c)), "trained <= finished", and its first
batch's warm-up: no step of a job before `bound.first_step_s` after its arrival window opens
(`batch` of its sessions cannot have finished by then but with probability 1e-9; its sessions
arrive only from `start_s`, at most its arrivals so far hold a slot). Every policy's
run -- cellflip's and every static split's -- is a feasible point of it in expectation (the
caveats of bound.py apply unchanged), so the bench asserts the bound above each of them.
Solved by bench/sim/lp.py; the figure is certified by weak duality.
"""

from __future__ import annotations

import math

import numpy as np

from .bound import Bound, _g_segments, _moments, first_step_s, warm_fraction
from .jobs import Job
from .lp import solve

BUCKETS = 160
"""Buckets over the horizon (18 min at 48 h): rows grow with (1 + 2 jobs) x buckets."""


def _job_block(job: Job, cells: int, H: float, edges: np.ndarray, warmup: bool = True) -> dict:
    """One job's columns: admissions per tick (boxed by its arrivals), trained tokens per
    bucket, training cells per bucket and tangent segment; units as bound.build's."""
    wl = job.wl
    tick = wl.tick_s
    span = np.diff(edges)
    s = np.arange(0.0, H, tick)
    arrivals = np.array([job.arrivals(x - tick, x) if x > 0 else 0 for x in s], dtype=float)
    m = np.asarray(wl.mean_hours_at(s, H), dtype=float) * 3600.0
    tau = edges[None, :] - s[:, None]
    i_cum, f_cum = _moments(wl, m[:, None], tau)
    occ = np.diff(i_cum, axis=1) / span[None, :]
    fin = f_cum[:, 1:] / m[:, None]
    lens, slopes = _g_segments(job.width, job.width, wl.scaling_efficiency)
    k, beta = wl.cell_capacity, wl.train_cell_s_per_token()
    rho = span / (beta * wl.session_tokens * k)
    if warmup:  # no step of the job before its first batch can have finished (bound.first_step_s)
        first = job.start_s + first_step_s(wl, cells, job.batch, H, job.start_s, job.cumulative)
        rho = rho * warm_fraction(edges, first)
    first = np.minimum(np.searchsorted(edges, s, side="right") - 1, span.size - 1)
    u_a = np.minimum(1.0 / np.maximum(occ[np.arange(s.size), first], 1e-9), arrivals / (k * cells))
    return dict(occ=occ, fin=fin, lens=lens, slopes=slopes, rho=rho, u_a=u_a,
                u_w=rho * float((lens * slopes).sum()) / cells, scale=wl.session_tokens * k * cells,
                u_z=(np.outer(rho > 0, lens) / cells).ravel())


def build(jobs: list[Job], cells: int, hours: float, buckets: int = BUCKETS,
          warmup: bool = True) -> tuple[np.ndarray, ...]:
    """The LP (c, A, b, u) over every job's block, and the unit of its objective (tokens/h)."""
    H = hours * 3600.0
    tick = jobs[0].wl.tick_s
    if any(j.wl.tick_s != tick for j in jobs):
        raise ValueError("every job of one fleet runs on the same controller tick")
    dt = max(tick, math.ceil(H / buckets / tick) * tick)
    B = math.ceil(H / dt)
    edges = np.minimum(np.arange(B + 1) * dt, H)
    blocks = [_job_block(j, cells, H, edges, warmup) for j in jobs]
    widths = [b["occ"].shape[0] + B + B * b["lens"].size for b in blocks]
    A = np.zeros(((1 + 2 * len(jobs)) * B, sum(widths)))
    rows = np.arange(B)
    c_parts, u_parts, col = [], [], 0
    unit = blocks[0]["scale"]
    for n, (blk, w) in enumerate(zip(blocks, widths)):
        C, L = blk["occ"].shape[0], blk["lens"].size
        r_tr, r_cum = (1 + 2 * n) * B, (2 + 2 * n) * B
        A[:B, col:col + C] = blk["occ"].T  # shared: every job's slots + training cells <= N
        for j in range(L):
            z = col + C + B + rows * L + j
            A[rows, z] = 1.0
            A[r_tr + rows, z] = -blk["rho"] * blk["slopes"][j]
        A[r_tr + rows, col + C + rows] = 1.0  # trained <= rho g(training cells)
        A[r_cum:r_cum + B, col + C:col + C + B] = np.tril(np.ones((B, B)))  # cumulative trained <= finished
        A[r_cum:r_cum + B, col:col + C] = -blk["fin"].T
        c_parts.append(np.concatenate([np.zeros(C), np.full(B, blk["scale"] / unit), np.zeros(B * L)]))
        u_parts.append(np.concatenate([blk["u_a"], blk["u_w"], blk["u_z"]]))
        col += w
    A[np.abs(A) < 1e-14] = 0.0
    b = np.concatenate([np.ones(B), np.zeros(2 * len(jobs) * B)])
    return np.concatenate(c_parts), A, b, np.concatenate(u_parts), np.array([unit / hours, B])


def jobs_upper_bound(jobs: list[Job], cells: int, hours: float, buckets: int = BUCKETS,
                     warmup: bool = True) -> Bound:
    """The relaxation's trained tokens per hour, all jobs together (certified upper bound);
    `warmup=False`: without the jobs' first-batch warm-up (the former relaxation)."""
    c, A, b, u, (unit, B) = build(jobs, cells, hours, buckets, warmup)
    r = solve(c, A, b, u)
    return Bound(tokens_per_hour=r.bound * unit, primal_tokens_per_hour=r.primal * unit,
                 gap=(r.bound - r.primal) / max(r.bound, 1e-12), buckets=int(B),
                 cohorts=int(sum(1 for _ in np.arange(0.0, hours * 3600.0, jobs[0].wl.tick_s))))

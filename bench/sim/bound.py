"""`upper_bound`: trained tokens per hour no policy of the simulator can beat on a workload.

A relaxation of the simulated system, solved as a linear program (bench/sim/lp.py, certified
by weak duality). What it keeps and what it frees:

- Cells: at every moment rollout cells + training cells <= N. Moves are free and instant, so
  only the time average of each role over a bucket of `dt` seconds is constrained.
- Sessions: the decision is how many start at each controller tick s (a policy admits only at
  ticks), each drawing its slot time D from the workload's log-normal of mean m(s) (capped),
  with tokens T * D / m(s). Admission timing is a decision: a session's expected tokens are T
  whatever m(s), so admitting while slot time is short yields more per slot-second. Expected
  slots held in bucket i by a session admitted at s: the mean over the bucket of P(D > t - s);
  the time-averaged occupancy of every bucket must fit the rollout cells' slots.
- Training: no batches, no staleness limit, no step-at-a-time: finished tokens are a fluid the
  trainer drains at g(c) = c * eff(c) cell-seconds per second on c cells (c <= the step's
  width), `train_cell_s_per_token` per token. g is concave, so over a bucket the trainer does
  at most dt * g(mean c) (Jensen), and the tangents of g bound it from above in the LP.
  Trained tokens up to the end of every bucket <= tokens of sessions finished by then
  (expected: (T / m(s)) * E[D; D <= t - s]); sessions still in flight at the horizon are
  therefore never trained.
- The first batch's warm-up: no training work before `first_step_s` (the share of a bucket
  after it only). Valid: a step starts only once `batch` sessions have finished; by time t at
  most N k slots have held sessions, each slot's one after another, so a slot has finished at
  most R sessions with P(R >= j) <= P(D <= t)**j (D of the shortest mean admitted by t: a
  log-normal's scale); a Chernoff bound on the sum of N k such counts puts the batch-th finish
  after `first_step_s` but with probability 1e-9 a run (a session counted in the slot that
  first admitted it, as the caveats below: none is suspended to make room for short ones); a
  sync round cut at its timeout trains fewer, so the warm-up ends by the earliest cut. It binds where a batch is a large share of
  the slots or the horizon short; on `stationary` at 1,000 cells (0.95 h) it moves the bound by
  under 0.01 %: "trained <= finished" already holds the fluid back until sessions finish.
- Nothing is charged: no KV copy, re-prefill, abort, broadcast, join or pause.

Every policy's run is a feasible point of this relaxation in expectation (its roles over time,
its admissions at ticks, its trained tokens), so the LP optimum is at least its expected
trained tokens; the bench asserts it against every seed's run. Where that argument is not
exact, and why it does not matter here: slot times are random (the bound holds for their
expectation; a session's tokens per slot-second, T / m(s), are exact); a cell still loading
weights starts its sessions `broadcast_s` after the tick (the bound starts them at the tick,
m(s) barely differs); and a suspended session stops holding a slot (the relaxation keeps every
admitted session decoding; the simulator's policies suspend only at a flip beyond the free room
and resume suspended sessions before admitting new ones, so none can hoard short sessions). A bound that ignored admission
timing (slot time averaged over time instead of decided per admission, `timing=False`) is not
one: a static split beats it on workloads whose slot time swings within a session's length
(tests/test_cluster_sim_bound.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from .lp import solve
from .workload import Workload

BUCKETS = 240
"""Buckets over the horizon (each at least one tick)."""
TANGENTS = 14
"""Tangent points of g between 1 cell and the step's width (a geometric grid)."""
SYNC_CUT_Q = 0.99
"""The lowest slot-time quantile a sync round is cut at (`sync_p99`): a cut round trains fewer
sessions than a batch, so the warm-up ends by the earliest cut (`sync_cut_s`)."""
FIRST_BATCH_RISK = 1e-9
"""Probability, per run, that a step starts before `first_step_s` (the warm-up's Chernoff bound)."""

_erf = np.frompyfunc(math.erf, 1, 1)


def _phi(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(x, dtype=float) / math.sqrt(2.0)).astype(float))


@dataclass
class Bound:
    tokens_per_hour: float
    """Certified upper bound on trained tokens per hour."""
    primal_tokens_per_hour: float
    """The relaxation's best plan found (equal to the bound when the solver converged)."""
    gap: float
    buckets: int
    cohorts: int


def _moments(wl: Workload, m_s: np.ndarray, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For slot time D' = min(D, cap), D log-normal of mean m_s: (E[min(D', tau)], E[D'; D' <= tau]),
    elementwise, 0 where tau <= 0."""
    cap = wl.session_cap_hours * 3600.0 if wl.session_cap_hours is not None else math.inf
    tau = np.asarray(tau, dtype=float)
    pos = tau > 0
    c = np.where(pos, np.minimum(tau, cap), 1.0)
    s = wl.session_sigma
    if s == 0.0:
        d = np.minimum(m_s, cap)
        i = np.minimum(d, c)
        f = np.where(d <= tau, d, 0.0)
    else:
        mu = np.log(m_s) - 0.5 * s * s
        part = m_s * _phi((np.log(c) - mu - s * s) / s)  # E[D; D <= c]
        tail = 1.0 - _phi((np.log(c) - mu) / s)  # P(D > c)
        i = part + c * tail
        f = part if cap == math.inf else np.where(tau >= cap, part + cap * tail, part)  # past the cap: all done
    return np.where(pos, i, 0.0), np.where(pos, f, 0.0)


def _finish_by(wl: Workload, m: np.ndarray, t: np.ndarray) -> np.ndarray:
    """P(min(D, cap) <= t), elementwise, D log-normal of mean m (the workload's sigma)."""
    cap = wl.session_cap_hours * 3600.0 if wl.session_cap_hours is not None else math.inf
    sg = wl.session_sigma
    if sg == 0.0:
        p = (m <= t).astype(float)
    else:
        p = _phi((np.log(np.maximum(t, 1e-300)) - np.log(m) + 0.5 * sg * sg) / sg)
    return np.where(t >= cap, 1.0, p)


def _log_tail(n: np.ndarray, p: np.ndarray, batch: int) -> np.ndarray:
    """Chernoff bound on log P(X >= batch), X a sum of n independent counts R with
    P(R >= j) <= p**j (each at most a geometric count: ln E e^(th R) <= ln((1 - p) / (1 - p e^th))),
    at the optimal e^th = batch / (p (n + batch)); 0 (no bound) where the mean reaches the batch."""
    n, p = np.asarray(n, dtype=float), np.clip(np.asarray(p, dtype=float), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = n * p / (1.0 - p)
        val = n * np.log((1.0 - p) * (n + batch) / n) - batch * np.log(batch / (p * (n + batch)))
    val = np.where(p <= 0.0, -np.inf, val)
    return np.where((n <= 0) | (p <= 0.0), -np.inf, np.where((p >= 1.0) | (mean >= batch), 0.0, val))


def first_step_s(wl: Workload, cells: int, batch: int, horizon_s: float, start_s: float = 0.0,
                 arrived=None) -> float:
    """Seconds after `start_s` (when the job's sessions may first be admitted) before which no
    training step starts, except with probability FIRST_BATCH_RISK: a step starts only once
    `batch` sessions have finished, and by `start_s + t` at most min(N k, arrived(start_s + t))
    slots have held a session, each slot's sessions running one after another, so the ones it
    finishes by then are at most a count R with P(R >= j) <= P(D <= t)**j (j independent slot
    times, each of the shortest mean admitted so far: a log-normal's scale) and their sum is
    bounded by `_log_tail`. `arrived`: expected-arrivals function (None: unlimited)."""
    tick = wl.tick_s
    if horizon_s - start_s <= 0:
        return 0.0
    s = start_s + np.arange(0.0, horizon_s - start_s, tick)
    t = s - start_s + tick
    m = np.minimum.accumulate(np.asarray(wl.mean_hours_at(s, horizon_s), dtype=float) * 3600.0)
    n = np.full(t.size, float(cells * wl.cell_capacity))
    if arrived is not None:
        n = np.minimum(n, np.floor(np.asarray(arrived(s + tick), dtype=float) + 1e-9))
    bad = np.flatnonzero(_log_tail(n, _finish_by(wl, m, t), batch) > math.log(FIRST_BATCH_RISK))
    return float(t[bad[0] - 1]) if bad.size and bad[0] > 0 else (0.0 if bad.size else float(t[-1]))


def sync_cut_s(wl: Workload, horizon_s: float) -> float:
    """The earliest a sync round can be cut (users' timeout or the p99 cut) from a round's start."""
    s = np.arange(0.0, horizon_s, wl.tick_s)
    m = float(np.min(np.asarray(wl.mean_hours_at(s, horizon_s), dtype=float))) * 3600.0
    q = m * math.exp(-0.5 * wl.session_sigma**2 + NormalDist().inv_cdf(SYNC_CUT_Q) * wl.session_sigma)
    cap = wl.session_cap_hours * 3600.0 if wl.session_cap_hours is not None else math.inf
    return min(q, wl.sync_timeout_mean_x * m, cap)


def warmup_s(wl: Workload, cells: int, horizon_s: float) -> float:
    """The single-job bound's warm-up: no training before it (module docstring)."""
    return min(first_step_s(wl, cells, wl.batch_for(cells)[0], horizon_s), sync_cut_s(wl, horizon_s))


def warm_fraction(edges: np.ndarray, first_s: float) -> np.ndarray:
    """Share of each bucket after `first_s`: training work can happen only then."""
    return np.clip((edges[1:] - np.maximum(edges[:-1], first_s)) / np.maximum(np.diff(edges), 1e-12), 0.0, 1.0)


def _g_segments(width: int, eff_width: int, efficiency: float) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, slopes) of a concave piecewise-linear upper envelope of g(c) = c * eff(c) on
    [0, width]: slope 1 up to one cell (eff = 1 there), then the tangents of c**p (p = 1 +
    ln(efficiency) / ln(eff_width), which is g past one cell)."""
    if width <= 1 or eff_width <= 1 or efficiency >= 1.0:
        return np.array([float(width)]), np.array([1.0])
    p = 1.0 + math.log(efficiency) / math.log(eff_width)
    pts = np.geomspace(1.0, width, TANGENTS)
    slope = p * pts ** (p - 1.0)
    val = pts**p
    # consecutive tangents meet at x: val_a + slope_a (x - a) = val_b + slope_b (x - b)
    x = (val[1:] - slope[1:] * pts[1:] - val[:-1] + slope[:-1] * pts[:-1]) / (slope[:-1] - slope[1:])
    edges = np.concatenate([[0.0, 1.0], x, [float(width)]])
    return np.diff(edges), np.concatenate([[1.0], slope])


def build(wl: Workload, cells: int, hours: float, width: int | None = None, timing: bool = True,
          buckets: int = BUCKETS, warmup: bool = True) -> tuple[np.ndarray, ...]:
    """The LP (c, A, b, u) in units of fleet-fulls of slots and of T * k * N tokens; see the
    module docstring. `width`: the widest training step (default the workload's at `cells`)."""
    H = hours * 3600.0
    tick = wl.tick_s
    dt = max(tick, math.ceil(H / buckets / tick) * tick)
    B = math.ceil(H / dt)
    edges = np.minimum(np.arange(B + 1) * dt, H)
    span = np.diff(edges)
    s = np.arange(0.0, H, tick)  # admission ticks (the cohorts)
    m = np.asarray(wl.mean_hours_at(s, H), dtype=float) * 3600.0
    if not timing:  # the negative control: one time-averaged slot time for every session
        m = np.full_like(m, float(np.asarray(wl.mean_hours_at(np.arange(0.0, H, 60.0), H)).mean()) * 3600.0)
    tau = edges[None, :] - s[:, None]  # cohort x edge
    i_cum, f_cum = _moments(wl, m[:, None], tau)
    occ = np.diff(i_cum, axis=1) / span[None, :]  # mean slots held per session in each bucket
    fin = f_cum[:, 1:] / m[:, None]  # expected finished tokens (units of T) by each bucket's end
    eff_width = wl.batch_for(cells)[1]
    lens, slopes = _g_segments(width or eff_width, eff_width, wl.scaling_efficiency)
    L, C = lens.size, s.size
    k, T, beta = wl.cell_capacity, wl.session_tokens, wl.train_cell_s_per_token()
    rho = span / (beta * T * k)  # tokens (units T k N) a bucket trains per fleet-share of g
    if warmup:  # no step before the first batch can have finished
        rho = rho * warm_fraction(edges, warmup_s(wl, cells, H))
    n = C + B + B * L
    A = np.zeros((3 * B, n))
    rows = np.arange(B)
    A[:B, :C] = occ.T  # occupancy (fleet shares of slots) + training cells <= 1
    for j in range(L):
        A[rows, C + B + rows * L + j] = 1.0
        A[B + rows, C + B + rows * L + j] = -rho * slopes[j]
    A[B + rows, C + rows] = 1.0  # trained tokens <= rho * g(training cells)
    A[2 * B:, C:C + B] = np.tril(np.ones((B, B)))  # cumulative trained <= finished by then
    A[2 * B:, :C] = -fin.T
    A[np.abs(A) < 1e-14] = 0.0  # rounding noise of the differences
    b = np.concatenate([np.ones(B), np.zeros(2 * B)])
    # boxes implied by the rows (they cut off nothing feasible)
    first = np.minimum(np.searchsorted(edges, s, side="right") - 1, B - 1)
    u_a = 1.0 / np.maximum(occ[np.arange(C), first], 1e-9)
    u_w = rho * float((lens * slopes).sum()) / cells
    u = np.concatenate([u_a, u_w, (np.outer(rho > 0, lens) / cells).ravel()])  # no training cells before then
    c = np.concatenate([np.zeros(C), np.ones(B), np.zeros(B * L)])
    return c, A, b, u, np.array([T * k * cells / hours, C, B])


def upper_bound(wl: Workload, cells: int, hours: float, width: int | None = None, timing: bool = True,
                buckets: int = BUCKETS, warmup: bool = True) -> Bound:
    """The relaxation's trained tokens per hour (certified upper bound; module docstring).
    `warmup=False`: without the first batch's warm-up (the former relaxation)."""
    c, A, b, u, (unit, C, B) = build(wl, cells, hours, width, timing, buckets, warmup)
    r = solve(c, A, b, u)
    return Bound(tokens_per_hour=r.bound * unit, primal_tokens_per_hour=r.primal * unit,
                 gap=(r.bound - r.primal) / max(r.bound, 1e-12), buckets=int(B), cohorts=int(C))

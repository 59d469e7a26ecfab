"""One simulated run of several jobs on one fleet -> `JobsRun`.

One line per tick: every job advances (exact finishes and training events) and measures its
rates -> one snapshot per job -> `cellflip`: `scheduler.planner.jobs.divide` on the jobs'
measured demand, `moves` and `cells_to_release` pick the cells, each drains (KV copies within
its job) and loads its new job's weights -> each job's `plan_flips` on the same snapshot (less
the cells that left) -> suspended sessions resume -> arrivals admitted into free slots, the
rest refused. `static`: a fixed split of cells between jobs, the same per-job planner.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from scheduler.control.rates import Rates
from scheduler.planner.jobs import FREE, JobShare, cells_to_release, demand_cells, divide, moves
from scheduler.planner.types import Snapshot

from .cluster import ROLLOUT
from .jobs import AWAY, Job, JobCluster, JobsWorkload, JobTrainer
from .policies import Planned
from .run import _demand, _slow_decoding

DEMAND_WINDOW_S = 600.0
"""Arrival rates are measured as an exponential average over about this long."""
HORIZON_S = 1800.0
"""`divide`'s horizon: a moved cell's expected use is counted over this long."""


class _OnSnapshot(Planned):
    """The cellflip planner, shown the tick's one snapshot (the division's) less departed cells."""

    snap: Snapshot | None = None

    def view(self, cl, t, snap):
        return self.snap if self.snap is not None else snap


@dataclass
class JobsRun:
    policy: str
    trained_tokens_per_hour: float
    per_job: dict[str, dict]
    cross_job_moves: int
    free_moves: int
    min_share_violation_s: float
    jain_fairness: float | None
    saturated_s: float
    wall_s: float
    split: dict[str, int] = field(default_factory=dict)


class JobState:
    """One job in a run: its cluster, trainer, measured rates and planner, and its counters."""

    def __init__(self, job: Job, n: int, hours: float, seed: int, index: int) -> None:
        wl = job.wl
        self.job = job
        self.tr = JobTrainer(job.batch, wl.train_cell_s_per_token(), job.width, wl.staleness_bound,
                             wl.scaling_efficiency, efficiency_width=job.width)
        self.tr.join_s = wl.train_join_s
        self.cl = JobCluster(job, n, hours, seed * 1000 + index, wl.tick_s, self.tr)
        self.rates = Rates()
        self.planner = _OnSnapshot("cellflip", "kv")
        self.seen_version, self.streaming, self.last_step = 0, 0.0, None
        self.occupied = self.offered = 0
        self.lam = None
        self.arrived = self.refused = self.refused_last = 0
        self.below_since: float | None = None
        self.violation_s = 0.0
        self.held_cell_s = 0.0

    def measure(self, t: float, dt: float) -> None:
        """Advance to `t` and measure, as the single-job run does (bench/sim/run.py)."""
        cl, tr, wl = self.cl, self.tr, self.job.wl
        cl.accepted_in_tick, cl.finished_in_tick, cl.freed_slot_s_in_tick = 0, 0, 0.0
        cl.advance(t)
        if tr.version > self.seen_version:
            self.streaming = wl.broadcast_s
        self.seen_version = tr.version
        if self.streaming > 0:
            _slow_decoding(cl, min(dt, self.streaming) * (1.0 - wl.broadcast_decode_ratio), t)
            self.streaming -= dt
        cl.refresh_busy()
        r = self.rates
        r.on_finish(cl.accepted_in_tick)
        r.on_tick(dt, max(0.0, self.occupied * dt - cl.freed_slot_s_in_tick) / dt, max(self.offered, self.occupied))
        if tr.last_step is not self.last_step:
            self.last_step = tr.last_step
            step_s, sessions, tokens, cells = tr.last_step
            r.on_trainer_report(_demand(tr), step_s, sessions, int(tokens), max(1, round(cells)))
        else:
            r.demand = _demand(tr)
        self.new = self.job.arrivals(t - dt, t)
        a = dt / (dt + DEMAND_WINDOW_S)
        self.lam = self.new / dt if self.lam is None else (1 - a) * self.lam + a * self.new / dt

    def share(self, t: float, snap: Snapshot) -> JobShare:
        """What `divide` is told: the job's bounds and its measured demand, in cells."""
        j, held = self.job, len(snap.cells)
        if not j.active(t):  # gone: its live sessions, packed onto whole cells, and its busy trainers
            live = math.ceil(sum(c.inflight for c in snap.cells) / self.cl.k) + sum(1 for c in snap.cells if c.busy)
            return JobShare(j.name, 0, min(held, live), j.spec.weight, float(live), held)
        return JobShare(j.name, j.min_cells, j.max_cells, j.spec.weight, self.demand(snap), held)

    def demand(self, snap: Snapshot) -> float:
        """`demand_cells` on the live sessions, the measured arrival rate (refused ones too), slot
        time and training rate. Before any session has finished: unbounded while the job refuses
        arrivals, else what it holds."""
        r, k = self.rates, self.cl.k
        fin = r.finish_rate_per_slot_s()
        if fin <= 0:
            return math.inf if self.refused_last > 0 else float(len(snap.cells))
        slot_s = 1.0 / fin
        if r.train_rate_per_cell_s > 0:
            train_s = 1.0 / r.train_rate_per_cell_s
        else:
            n_train = sum(1 for c in snap.cells if c.role == "training")
            train_s = n_train / max(1, len(snap.cells) - n_train) * slot_s / k
        return demand_cells(self.lam or 0.0, slot_s, k, train_s, live_sessions=float(self.cl.inflight.sum()),
                            lead_s=HORIZON_S)

    def act(self, t: float, snap: Snapshot | None) -> None:
        """Flips by the planner (on `snap` when given), resumptions, admissions."""
        cl = self.cl
        if len(cl.held()):
            self.planner.snap = snap
            self.planner.tick(cl, t, self.rates)
        cl.resume_suspended(t)
        admitted = cl.admit(t, self.new) if self.new else 0
        self.arrived += self.new
        self.refused_last = self.new - admitted
        self.refused += self.refused_last
        cl.refresh_busy()
        self.occupied = int(cl.inflight.sum())
        self.offered = int((cl.role == ROLLOUT).sum()) * cl.k

    def account(self, t: float, dt: float, grace_s: float) -> None:
        """Held cell-time, and time below the minimum in cells that serve (their move into the
        job done: drained and loaded) past `grace_s`."""
        cl, j = self.cl, self.job
        held = cl.held()
        self.held_cell_s += held.size * dt
        serving = int((cl.joined_at[held] <= t).sum())
        below = j.active(t) and serving < j.min_cells
        if below and self.below_since is None:
            self.below_since = max(t - dt, j.start_s)  # below since the tick before, or since it arrived
        elif not below and self.below_since is not None:
            self.violation_s += max(0.0, t - self.below_since - grace_s)
            self.below_since = None
        self.grace_s = grace_s


def run_jobs(jw: JobsWorkload, cells: int, hours: float | None = None, seed: int = 0,
             split: dict[str, int] | None = None, check: bool = False,
             on_tick=None) -> JobsRun:
    """`split` None: cellflip (the fleet divided every tick); else that fixed split (static; a
    job it leaves out is not simulated: a static split's jobs never interact, so the grid runs
    each job alone at each cell count)."""
    wall0 = time.perf_counter()
    hours = hours or jw.hours
    jobs = [Job(s, jw, cells) for s in jw.jobs]
    states = [JobState(j, cells, hours, seed, i) for i, j in enumerate(jobs) if split is None or j.name in split]
    owner = np.full(cells, -1)
    tick = jobs[0].wl.tick_s
    wl0 = jobs[0].wl
    drain_s = wl0.cell_capacity * wl0.session_tokens * wl0.kv_bytes_per_token / wl0.inter_node_bytes_per_s
    knobs = dict(hysteresis_cells=max(1.0, 0.01 * cells), move_cost_s=jw.load_s + drain_s, horizon_s=HORIZON_S)
    start = split or divide([JobShare(j.name, j.min_cells if j.active(0) else 0, j.max_cells if j.active(0) else 0,
                                      j.spec.weight, math.inf, 0) for j in jobs], cells, **knobs)
    at = 0
    for st in states:
        n = start.get(st.job.name, 0)
        st.cl.acquire(list(range(at, at + n)), 0.0, 0.0)
        st.cl.sync_trainer_cells(0.0)
        owner[at:at + n] = jobs.index(st.job)
        at += n
    counts = {"cross": 0, "free": 0}
    fair = [0.0, 0.0]
    n_ticks = math.ceil(hours * 3600.0 / tick)
    for k in range(1, n_ticks + 1):
        t = min(k * tick, hours * 3600.0)
        dt = t - (k - 1) * tick
        for st in states:
            st.measure(t, dt)
        snaps = [st.cl.snapshot(t, st.rates) for st in states]
        if split is None:
            snaps = _divide_tick(states, snaps, owner, cells, t, jw.load_s, knobs, counts)
        for st, snap in zip(states, snaps):
            st.act(t, snap if split is None else None)
            st.account(t, dt, tick + jw.load_s + drain_s)
            if check:
                st.cl.check_integrity()
                assert not (st.cl.inflight[st.cl.role == AWAY]).any(), "a cell of another job holds sessions"
        _fairness(states, t, dt, fair)
        if on_tick is not None:
            on_tick(states, owner, t)
    return _result(states, hours, split, counts, fair, wall0)


def _divide_tick(states: list[JobState], snaps: list[Snapshot], owner: np.ndarray, cells: int, t: float,
                 load_s: float, knobs: dict, counts: dict) -> list[Snapshot]:
    """The division between jobs on this tick's snapshots; returns them less the cells that left."""
    shares = [st.share(t, s) for st, s in zip(states, snaps)]
    targets = divide(shares, cells, **knobs)
    pairs = moves(targets, {s.name: s.held for s in shares})
    if not pairs:
        return snaps
    index = {st.job.name: i for i, st in enumerate(states)}
    gone: dict[int, set] = {}
    for src in dict.fromkeys(p[0] for p in pairs):
        dsts = [d for s, d in pairs if s == src]
        if src == FREE:
            ids, ready = np.flatnonzero(owner == -1)[: len(dsts)].tolist(), t + load_s
        else:
            i = index[src]
            ids = [int(c) for c in cells_to_release(snaps[i].cells, len(dsts))]
            ready = t + states[i].cl.release(ids, t) + load_s
            gone[i] = set(ids)
        for c, d in zip(ids, dsts):
            owner[c] = -1 if d == FREE else index[d]
            if d != FREE:
                states[index[d]].cl.acquire([c], t, ready)
                states[index[d]].cl.sync_trainer_cells(t)
            counts["cross" if FREE not in (src, d) else "free"] += 1
    return [s if i not in gone else _without(s, gone[i]) for i, s in enumerate(snaps)]


def _without(snap: Snapshot, gone: set) -> Snapshot:
    return dataclasses.replace(snap, cells=tuple(c for c in snap.cells if c.cell_id not in gone))


def _fairness(states: list[JobState], t: float, dt: float, fair: list[float]) -> None:
    """Jain's index of held cells over weight, while every active job (two or more) refuses arrivals."""
    act = [st for st in states if st.job.active(t)]
    if len(act) < 2 or any(st.refused_last <= 0 for st in act):
        return
    x = np.array([len(st.cl.held()) / st.job.spec.weight for st in act], dtype=float)
    fair[0] += dt * float(x.sum() ** 2 / (len(x) * (x * x).sum()))
    fair[1] += dt


def _result(states: list[JobState], hours: float, split, counts: dict, fair: list[float], wall0: float) -> JobsRun:
    per = {}
    for st in states:
        st.cl.close_books()
        if st.below_since is not None:
            st.violation_s += max(0.0, hours * 3600.0 - st.below_since - st.grace_s)
        per[st.job.name] = {
            "trained_tokens_per_hour": round(st.tr.trained_tokens_equivalent() / hours, 1),
            "refused_fraction": round(st.refused / st.arrived, 4) if st.arrived else 0.0,
            "mean_cells": round(st.held_cell_s / (hours * 3600.0), 1),
            "min_share_violation_s": round(st.violation_s, 1),
            # decoded but never trained: in flight, waiting or in the running step at the horizon, or dropped
            "untrained_tokens_per_hour": round((st.cl.decoded_tokens - st.tr.trained_tokens_equivalent()) / hours, 1),
        }
    return JobsRun(
        policy="cellflip" if split is None else "static",
        trained_tokens_per_hour=sum(st.tr.trained_tokens_equivalent() for st in states) / hours,
        per_job=per, cross_job_moves=counts["cross"], free_moves=counts["free"],
        min_share_violation_s=round(sum(st.violation_s for st in states), 1),
        jain_fairness=round(fair[0] / fair[1], 4) if fair[1] > 0 else None, saturated_s=fair[1],
        wall_s=time.perf_counter() - wall0, split=dict(split or {}))

"""Several RL jobs on one simulated fleet: the jobs' workloads, and a job's view of the fleet.

A job is today's simulator on the cells it holds: its own `Cluster` over all N cells, the
cells it does not hold marked `AWAY` (no sessions, no summary, not a destination), its own
trainer, its own measured rates and its own planner. Sessions arrive at the job's rate
(deterministic: the integral of the rate, floored), are admitted into free slots at the tick
or refused (they never queue, as in the single-job simulator, whose harnesses always had one
waiting). A cell leaves a job by a drain (its sessions move by KV copy to the job's other
cells, or suspend), then loads the new job's weights (`load_s`) before it serves there.

The three workloads of issue 47 (`JOB_WORKLOADS`), 1,000 cells, 48 h, every job on the
`stationary` workload's session lengths (log-normal, mean 2 h, sigma 0.4) unless said:
- anti_phase: two jobs of equal weight, min 10% each, arrival rate of each a sine of period
  6 h and +-60% amplitude, in anti-phase; the mean rate of each fills 45% of the fleet (the
  fleet has 10% headroom over the jobs' mean demand).
- arrive_leave: job A constant, job B from 12 h to 36 h; both arrive faster than the whole
  fleet could serve (saturated), equal weight, min 10% each (B's only while it exists).
- three_stationary: three jobs on `heavy_tail` session lengths (p99 10x the mean, capped at
  24 h), each with its own draws, constant rates each worth 40% of the fleet (all saturated).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from scheduler.planner.types import Snapshot

from .cluster import LOADING, ROLLOUT, Cluster
from .trainer import Trainer
from .workload import Workload, load_workload

AWAY = 3
"""Role of a cell another job holds (or no job: the free pool)."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    workload: str
    """Session lengths, training cost and links (configs/sim/NAME.yaml)."""
    demand_frac: float
    """Mean arrival rate, as the share of the fleet its sessions and their training would fill."""
    min_frac: float = 0.1
    max_frac: float = 1.0
    weight: float = 1.0
    sine_amplitude: float = 0.0
    sine_period_h: float = 6.0
    sine_phase: float = 0.0
    """Radians: the rate is mean x (1 + amplitude x sin(2 pi t / period + phase))."""
    start_h: float = 0.0
    end_h: float | None = None


@dataclass(frozen=True)
class JobsWorkload:
    name: str
    jobs: tuple[JobSpec, ...]
    hours: float = 48.0
    load_s: float = 20.0
    """Weight load of a cell joining a job (after its drain)."""
    gain_expected: bool = True


JOB_WORKLOADS = {
    "anti_phase": JobsWorkload("anti_phase", (
        JobSpec("a", "stationary", 0.45, sine_amplitude=0.6),
        JobSpec("b", "stationary", 0.45, sine_amplitude=0.6, sine_phase=math.pi))),
    "arrive_leave": JobsWorkload("arrive_leave", (
        JobSpec("a", "stationary", 2.0),
        JobSpec("b", "stationary", 2.0, start_h=12.0, end_h=36.0))),
    "three_stationary": JobsWorkload("three_stationary", (
        JobSpec("a", "heavy_tail", 0.4), JobSpec("b", "heavy_tail", 0.4), JobSpec("c", "heavy_tail", 0.4)),
        gain_expected=False),
}


class Job:
    """One job's fixed facts at a fleet size: workload, rate, bounds, batch."""

    def __init__(self, spec: JobSpec, jw: JobsWorkload, cells: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.wl: Workload = load_workload(spec.workload)
        wl = self.wl
        self.batch, self.width = wl.batch_for(cells)
        """A job's batch and step width are the workload's at the whole fleet: a job's batch is
        its own, not its share's (a smaller one on a job that then holds the fleet would publish
        versions faster than its sessions finish within the staleness bound)."""
        self.slot_s = wl.session_mean_hours * 3600.0
        self.train_s = wl.session_tokens * wl.train_cell_s_per_token()
        self.rate = spec.demand_frac * cells / (self.slot_s / wl.cell_capacity + self.train_s)
        """Mean arrivals a second while active."""
        self.min_cells = math.ceil(spec.min_frac * cells - 1e-9)
        self.max_cells = math.floor(spec.max_frac * cells + 1e-9)
        self.start_s = spec.start_h * 3600.0
        self.end_s = math.inf if spec.end_h is None else spec.end_h * 3600.0

    def active(self, t: float) -> bool:
        return self.start_s <= t < self.end_s

    def cumulative(self, t: np.ndarray | float) -> np.ndarray:
        """Expected arrivals in [0, t]."""
        s = self.spec
        u = np.clip(np.asarray(t, dtype=float), self.start_s, min(self.end_s, 1e18))
        w = 2 * math.pi / (s.sine_period_h * 3600.0)
        wave = (np.cos(w * self.start_s + s.sine_phase) - np.cos(w * u + s.sine_phase)) / w
        return self.rate * ((u - self.start_s) + s.sine_amplitude * wave)

    def arrivals(self, t0: float, t1: float) -> int:
        """Sessions arriving in (t0, t1] (the integral floored: no randomness)."""
        return int(math.floor(float(self.cumulative(t1)) + 1e-9) - math.floor(float(self.cumulative(t0)) + 1e-9))


class JobTrainer(Trainer):
    """A job's trainer: while its cells leave the job, their KV sending delays their arrival
    at the next job, not this job's step (`releasing`)."""

    releasing = False
    released_s = 0.0

    def send_kv(self, seconds: float, cells: int) -> None:
        if self.releasing:
            self.released_s += seconds
            return
        super().send_kv(seconds, cells)


class JobCluster(Cluster):
    """A job's cells: the fleet's arrays, the cells it does not hold `AWAY`."""

    def __init__(self, job: Job, n_cells: int, hours: float, seed: int, tick_s: float, trainer: JobTrainer) -> None:
        super().__init__(job.wl, n_cells, hours, seed, tick_s, "kv", trainer)
        self.role[:] = AWAY
        self._dirty[:] = False
        self.jtrainer = trainer
        self.joined_at = np.full(n_cells, np.inf)
        """When each held cell's move into the job is done (drained elsewhere, weights loaded)."""

    def held(self) -> np.ndarray:
        return np.flatnonzero(self.role != AWAY)

    def snapshot(self, t: float, rates=None) -> Snapshot:
        """The job's cells only (the planner never sees, nor places on, another job's)."""
        away = self.role == AWAY
        self._dirty[away] = False
        self._tokens[away] = 0
        snap = super().snapshot(t, rates)
        cells = tuple(self._summaries[i] for i in np.flatnonzero(~away).tolist())
        return dataclasses.replace(snap, cells=cells)

    def _tokens_per_cell(self, t: float) -> np.ndarray:
        out = super()._tokens_per_cell(t)
        out[self.role == AWAY] = 0  # a leaving cell's sessions are its job's to place, not a summary
        return out

    def acquire(self, cells: list[int], t: float, ready_at: float) -> None:
        """Cells join the job: they serve (rollout) from `ready_at` (their weights loaded)."""
        if not cells:
            return
        self.set_roles(cells, LOADING if ready_at > t else ROLLOUT, t)
        self.ready_at[np.asarray(cells)] = ready_at
        self.joined_at[np.asarray(cells)] = ready_at

    def release(self, cells: list[int], t: float) -> float:
        """Cells leave the job: training ones leave its trainer, rollout ones drain to the job's
        other cells (KV copy, or suspend). Returns the mean seconds a cell spent sending."""
        if not cells:
            return 0.0
        serving = [c for c in cells if self.role[c] != AWAY and self.inflight[c] > 0]
        self.set_roles(cells, AWAY, t)
        self.joined_at[np.asarray(cells)] = np.inf
        self.sync_trainer_cells(t)
        tr = self.jtrainer
        tr.releasing, tr.released_s = True, 0.0
        try:
            self.drain(serving, t)
        finally:
            tr.releasing = False
        self._tokens[np.asarray(cells)] = 0
        return tr.released_s

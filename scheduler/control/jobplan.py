"""Each RL job's own planning on a fleet shared by several (docs/JOBS.md): one read of the
cells, split into one planner `Snapshot` per job, from which both the division between jobs
(each job's demand: its open sessions and its training) and each job's own rollout vs
training flips are decided.

One line: the live cells' summaries (read once) -> split by job (a cell's recorded job; none:
`default`) -> per job: its training cells busy as its own trainer's running steps keep them,
its own rates (its trainer's reports; its cells' slots and finishes), its own trajectories
waiting, version, staleness bound and `min_rollout_cells` -> `Snapshot` -> `demand` (for `divide`) and
`plan_flips` (its flips, only when its trainer has declared its demand).

While no cell is recorded under a job other than `default`, the fleet's own snapshot and flip
planner run exactly as on a one-job fleet (scheduler/control/reconcile.py); this module is
used only on a shared fleet, and for the division's demand whenever several jobs exist.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from scheduler.contract.states import ROLLOUT_SIDE
from scheduler.control import jobsettings
from scheduler.control.snapshot import UNKNOWN_VERSION
from scheduler.planner.jobs import demand_cells
from scheduler.planner.types import CellSummary, Snapshot
from scheduler.store.jobs import DEFAULT_JOB

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.flips import Flips
    from scheduler.control.rates import Rates
    from scheduler.control.snapshot import CellSummaries
    from scheduler.control.staleness import Staleness
    from scheduler.control.versions import Versions


class JobPlanner:
    """Owns `last_tick` (when each job's rollout rates were last folded in)."""

    def __init__(self, ctx: Context, rates: Rates, cells: CellSummaries, flips: Flips, staleness: Staleness,
                 versions: Versions) -> None:
        self.ctx, self.rates, self.cells, self.flips = ctx, rates, cells, flips
        self.staleness, self.versions = staleness, versions
        self.last_tick: float | None = None

    def snapshots(self, jobs: list[str], members: dict[str, frozenset[str]]) -> dict[str, Snapshot]:
        """One `Snapshot` per job of `jobs` (`members`: job → its recorded cells, jobs other than
        `default`), from one read of the live cells; each job's rollout rates advance by the
        time since the last call (its cells' occupied and offered slots)."""
        owner = {cid: job for job, cells in members.items() for cid in cells}
        split: dict[str, list[CellSummary]] = {j: [] for j in jobs}
        for c in self.cells.current(None, self.flips.pinned_training):
            split.setdefault(owner.get(c.cell_id, DEFAULT_JOB), []).append(c)
        now = self.ctx.clock()
        dt = 0.0 if self.last_tick is None else now - self.last_tick
        self.last_tick = now
        return {job: self._snapshot(job, cells, dt) for job, cells in split.items()}

    def _snapshot(self, job: str, cells: list[CellSummary], dt: float) -> Snapshot:
        roll, train = self.rates.job(job), self.rates.trainer(job)
        occupied = offered = 0
        for c in cells:
            if c.role in ROLLOUT_SIDE:
                occupied += c.inflight
                offered += c.capacity
        roll.on_tick(dt, occupied, offered)
        demand = train.demand
        steps = demand.steps_in_progress if demand else 0
        width = demand.max_cells_per_step if demand else 0
        training = sorted(c.cell_id for c in cells if c.role == "training" and not c.busy)
        busy = set(training[: steps * width if width else (len(training) if steps else 0)])
        if busy:
            cells = [dataclasses.replace(c, busy=True) if c.cell_id in busy else c for c in cells]
        target = self.versions.target(job)
        return Snapshot(
            cells=tuple(cells), finished_waiting=self.staleness.finished_waiting(job),
            batch_size=demand.batch_size if demand else 1, training_in_progress=steps > 0,
            min_rollout_cells=jobsettings.min_rollout_cells(self.ctx.cfg, self.ctx.store.jobs.get(job)),
            queued_sessions=self.ctx.store.jobs.requests_in(job, ("queued",)),
            version=UNKNOWN_VERSION if target is None else target.v,
            staleness_bound=self.staleness.bound_of(job), steps_in_progress=steps,
            max_cells_per_step=width or max(1, len(cells)),
            finish_rate_per_slot_s=roll.finish_rate_per_slot_s(), slot_occupancy=roll.slot_occupancy(),
            train_rate_per_cell_s=train.train_rate_per_cell_s, train_step_s=train.train_step_s,
            tokens_per_step=train.tokens_per_step,
            max_concurrent_steps=demand.max_concurrent_steps if demand else 1)

    def demand(self, job: str, snap: Snapshot | None, live_sessions: int, slots: int) -> int:
        """Whole cells `job` could use now: its open sessions over a cell's slots, plus its
        training cells (`demand_cells`: the sessions' finish rate x its trainer's measured
        cell-seconds a session; at least the training cells its running steps keep busy)."""
        roll, train = self.rates.job(job), self.rates.trainer(job)
        q = train.train_rate_per_cell_s
        cells = demand_cells(0.0, roll.mean_slot_s(), max(1, slots), 1.0 / q if q > 0 else 0.0,
                             live_sessions=float(live_sessions))
        busy = sum(1 for c in snap.cells if c.role == "training" and c.busy) if snap is not None else 0
        return math.ceil(max(cells, live_sessions / max(1, slots) + busy) - 1e-9)

    def flip(self, snaps: dict[str, Snapshot]) -> None:
        """Each job's own flips (`plan_flips` on its snapshot), for the jobs whose trainer
        declared its demand, when the fleet plans flips itself (`auto_flip`)."""
        if not self.ctx.cfg.auto_flip:
            return
        for job, snap in snaps.items():
            if snap.cells and self.rates.trainer(job).demand is not None:
                self.flips.autonomous(snap)

"""Each RL job's own `min_rollout_cells` on a fleet shared by several (docs/JOBS.md).

A flip to training of a job's cell — a trainer's explicit flip or the planner's — keeps at least
the job's `settings.min_rollout_cells` (else the fleet's `scheduler.min_rollout_cells`) of the
job's OWN verified rollout cells serving its agents; the fleet's `min_rollout_cells` still holds
over every job's cells together (scheduler/control/flips.py). The drain of a cell moving to
another job is not held by it: how many cells a job keeps is the division's decision (its
`min_cells`; the planner never takes a job's last rollout cell while it has open sessions) or an
admin's. On a fleet serving one job (no cell recorded under another) nothing is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.control import jobsettings
from scheduler.store.jobs import DEFAULT_JOB

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.flips import Flips
    from scheduler.control.jobs import Jobs


class JobFloor:
    """Owns nothing: reads the jobs' membership, the fleet's tally of rollout cells and trust."""

    def __init__(self, ctx: Context, jobs: Jobs, flips: Flips) -> None:
        self.ctx, self.jobs, self.flips = ctx, jobs, flips

    def short(self, cell_id: str, leaving: set[str] | None = None) -> str | None:
        """Why flipping `cell_id` to training would leave its job fewer than its own
        `min_rollout_cells` rollout cells (None: it would not, or the fleet serves one job).
        `leaving`: cells flipping to training (read from the store when None)."""
        members = self.jobs.members()
        if not members:
            return None
        if self.ctx.store.jobs.active_move_for(cell_id) is not None:
            return None  # leaving its job: the division's (or an admin's) call
        job = next((j for j, cells in members.items() if cell_id in cells), DEFAULT_JOB)
        need = jobsettings.min_rollout_cells(self.ctx.cfg, self.ctx.store.jobs.get(job))
        if need <= 0:
            return None
        if leaving is None:
            leaving = self.ctx.store.fleet.flipping_cells("training")
        flips = self.flips
        flips.tally.advance(self.ctx.clock())
        rollout = flips.tally.rollout
        if job == DEFAULT_JOB:
            others = frozenset().union(*members.values())
            pool = (c for c in rollout if c not in others)
        else:
            pool = (c for c in members.get(job, ()) if c in rollout)
        found = 0
        for c in pool:
            if c != cell_id and c not in leaving and flips.trust.counts(c):
                found += 1
                if found >= need:
                    return None
        return (f"flipping {cell_id} would leave job {job!r} fewer than {need} rollout cells of its own "
                f"(its min_rollout_cells)")

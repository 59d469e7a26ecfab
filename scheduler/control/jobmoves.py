"""A cell's move from one RL job to another: drain → reassign → load → serve.

    draining: a flip to training drains the cell; its live rollouts move by live KV migration to
              its old job's other cells only (`Context.placeable`: never another job's cell);
    loading:  the cell is recorded under the new job (in the transaction that ends `draining`)
              and a flip back to rollout loads the version the fleet serves now, then serves;
    done      (or `undone`: the cell went down, or its drain rolled back, before the reassignment).

The move is recorded (`job_moves`) before anything of it happens, and every step is
level-triggered from that record and the cell's state, so a scheduler restarted in the middle
finishes it (or undoes it, if the cell is gone). Both flips are ordinary flips (their own
durable records and histories): a move adds no new path for a request.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict, Invalid, NotFound
from scheduler.control import jobmodels
from scheduler.store.jobs import DEFAULT_JOB, MoveRow

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.flips import Flips
    from scheduler.control.jobs import Jobs


START_TIMEOUT_S = 60.0
"""A move whose drain cannot start this long (its flip refused) is undone, so it does not hold
the planner's next move back."""


class JobMoves:
    """Carries out `job_moves` records; owns no state beyond the store's rows."""

    def __init__(self, ctx: Context, jobs: Jobs, flips: Flips) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.flips = flips

    def start(self, cell_id: str, to_job: str, reason: str = "requested") -> dict[str, Any]:
        """Record the move of `cell_id` to `to_job` (durable); the loop carries it out."""
        ctx, store = self.ctx, self.ctx.store
        to = self.jobs.require(to_job)
        if to.state != "active":
            raise Conflict(f"job {to_job!r} is {to.state}: no cell moves into it", code="job_draining")
        with ctx.txn(durable=True):
            cell = store.fleet.get_cell(cell_id)
            if cell is None or cell.state == "down":
                raise NotFound(f"unknown or down cell {cell_id!r}")
            src = store.jobs.job_of("cell", cell_id)
            if src == to_job:
                raise Invalid(f"cell {cell_id} already serves job {to_job!r}")
            jobmodels.check(store, to, cell_id, cell.capabilities)  # 409 `model_mismatch`
            if store.jobs.active_move_for(cell_id) is not None:
                raise Conflict(f"cell {cell_id} is already moving between jobs", code="move_in_progress")
            if cell.state not in ("rollout", "training") or store.fleet.active_flip_for(cell_id) is not None:
                raise Conflict(f"cell {cell_id} is {cell.state} with a flip under way; move it once it is settled",
                               code="flip_in_progress")
            now = time.time()
            move = MoveRow(f"move-{uuid.uuid4().hex[:12]}", cell_id, src, to_job, "draining", reason, now)
            move.history.append(("draining", now, f"{src} → {to_job}: {reason}"))
            store.jobs.put_move(move)
        ctx.kick()
        self.step_one(move)
        return store.jobs.get_move(move.id).to_api()  # type: ignore[union-attr]

    def step(self) -> None:
        for move in self.ctx.store.jobs.list_moves(active_only=True):
            self.step_one(move)

    def step_one(self, move: MoveRow) -> None:
        """One level-triggered look at a move: what the store and the cell say now decides."""
        store = self.ctx.store
        cell = store.fleet.get_cell(move.cell_id)
        flip = store.fleet.active_flip_for(move.cell_id)
        if cell is None or cell.state == "down":
            if move.state == "draining":
                self._end(move, "undone", "the cell went down before it was reassigned")
            else:  # reassigned already: the cell comes back under its new job
                self._end(move, "done", "the cell went down after its reassignment")
            return
        if flip is not None:
            return  # a drain or a load under way: wait for it
        if move.state == "draining" and self._stuck(move):
            return
        if move.state == "draining":
            if cell.state == "training":
                self._reassign(move)
                self._flip(move, "rollout")
            elif cell.state == "rollout":
                if self._last_flip_ended(move, "training") in ("rolled_back", "failed"):
                    self._end(move, "undone", "the drain rolled back")
                else:
                    self._flip(move, "training")
        elif move.state == "loading":
            if cell.state == "rollout":
                self._end(move, "done", f"serving job {move.to_job}")
            elif cell.state == "training":
                self._flip(move, "rollout")

    def _stuck(self, move: MoveRow) -> bool:
        """Undo a move not yet reassigned whose destination job is no longer active, or whose
        drain could not start (e.g. `min_rollout_cells`) for `START_TIMEOUT_S`."""
        to = self.ctx.store.jobs.get(move.to_job)
        if to is None or to.state != "active":
            cell = self.ctx.store.fleet.get_cell(move.cell_id)
            if cell is not None and cell.state == "training":  # drained already: back to its job's rollouts
                self._flip(move, "rollout")
            self._end(move, "undone", f"job {move.to_job} is no longer active")
            return True
        started = any(h[0].startswith("flip_") for h in move.history)
        if not started and time.time() - move.created_at > START_TIMEOUT_S:
            self._end(move, "undone", f"its drain could not start within {START_TIMEOUT_S:g}s")
            return True
        return False

    def _last_flip_ended(self, move: MoveRow, to: str) -> str | None:
        """How the move's last flip to `to` ended (None: it made none)."""
        flip_id = next((h[2] for h in reversed(move.history) if h[0] == f"flip_{to}"), None)
        flip = self.ctx.store.fleet.get_flip(flip_id) if flip_id else None
        return None if flip is None else flip.state

    def _flip(self, move: MoveRow, to: str) -> None:
        try:
            out = self.flips.request(to, move.cell_id, None, None)
        except Conflict as e:  # e.g. min_rollout_cells: tried again next tick
            if move.history[-1][0] != "waiting":
                self._note(move, "waiting", str(e))
            return
        self._note(move, f"flip_{to}", out["id"])

    def plan(self, planned: list[tuple[str, str]]) -> None:
        """Start the first of the planner's moves when no move is under way: the source job's
        rollout cell cheapest to drain, so long as the job keeps another rollout cell."""
        store = self.ctx.store
        if not planned or store.jobs.list_moves(active_only=True):
            return
        rows = store.fleet.planning_rows()
        jobs = store.jobs.jobs_of("cell", [r.cell_id for r in rows])
        flipping = store.fleet.flipping_cells()
        fleet = jobmodels.fleet_model(store)
        for src, dst in planned:  # the free pool ("") is the implicit job's cells here
            src, dst = src or DEFAULT_JOB, dst or DEFAULT_JOB
            to = store.jobs.get(dst)
            if src == dst or to is None:
                continue
            mine = sorted((r.live, r.tokens, r.cell_id) for r in rows
                          if jobs[r.cell_id] == src and r.state == "rollout" and r.cell_id not in flipping
                          and jobmodels.compatible(to.model, jobmodels.cell_model(r.capabilities), fleet))
            if len(mine) >= 2 or (mine and not store.jobs.live_sessions().get(src)):
                self.start(mine[0][2], dst, "the planner's division of the fleet")
                return

    def _reassign(self, move: MoveRow) -> None:
        """The cell is drained (no request of the old job on it): record it under the new job."""
        store = self.ctx.store
        with self.ctx.txn(durable=True):
            store.jobs.assign("cell", move.cell_id, move.to_job)
            move.state = "loading"
            move.history.append(("loading", time.time(), f"drained; now a cell of {move.to_job}"))
            store.jobs.put_move(move)
        self.jobs.forget_members()

    def _note(self, move: MoveRow, what: str, detail: str) -> None:
        with self.ctx.txn(durable=True):
            move.history.append((what, time.time(), detail))
            self.ctx.store.jobs.put_move(move)

    def _end(self, move: MoveRow, state: str, detail: str) -> None:
        with self.ctx.txn(durable=True):
            move.state = state
            move.finished_at = time.time()
            move.history.append((state, move.finished_at, detail))
            self.ctx.store.jobs.put_move(move)
        if state == "done":
            self.ctx.metrics.job_moves.labels(move.from_job, move.to_job).inc()

"""Flips: a cell changes role without killing a live rollout.

To training:  pending → draining (migrate every request out; suspend what is left at the drain
deadline) → set_role training → the cell reports role "training" → done.
To rollout:   pending → loading (set_role rollout with the current version) → the cell reports
role "rollout" → done.

The flip row is written (pending) before anything happens and every step is level-triggered
from the store, so a restarted scheduler continues a flip from its recorded state: it
completes, or rolls back (rollout capacity fell under `min_rollout_cells`, the cell could not
load), or fails (the cell was lost) — and never runs twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict, NotFound
from scheduler.contract.failpoints import failpoint
from scheduler.contract.protocol import SetRoleCmd
from scheduler.contract.states import CELL, FLIP, set_state
from scheduler.control import idempotency
from scheduler.control.drains import DrainSlices
from scheduler.control.versions import training_host
from scheduler.planner import placement
from scheduler.store.fleet import FlipRow

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.migrations import Migrations
    from scheduler.control.ownership import Ownership
    from scheduler.control.scoring import Scoring
    from scheduler.control.tally import FleetTally
    from scheduler.control.trust import Trust
    from scheduler.control.versions import Versions
    from scheduler.planner.types import Snapshot
    from scheduler.store.fleet import CellRow
    from scheduler.store.owners import RequestRow

log = logging.getLogger("cellflip.scheduler")

IDEMPOTENCY_SCOPE = "flips"

ALIGN_FLIP_ID = "align"
"""The flip id of a `set_role` that restates a settled role (no flip is under way)."""


class Flips:
    """Role changes of cells. Owns `drain_deadline`, `pinned_training` and `role_sent`."""

    def __init__(self, ctx: Context, ownership: Ownership, migrations: Migrations, versions: Versions,
                 scoring: Scoring, snapshot: Callable[[], Snapshot], tally: FleetTally, trust: Trust) -> None:
        self.ctx = ctx
        self.trust = trust
        self.tally = tally
        self.ownership = ownership
        self.migrations = migrations
        self.versions = versions
        self.scoring = scoring
        self.snapshot = snapshot
        self.drain_deadline: dict[str, float] = {}
        self.load_deadline: dict[str, float] = {}
        """flip id → when a flip to rollout that has not loaded its version rolls back."""
        """flip id → monotonic drain deadline (restarts at now + drain_deadline_s after a restart)."""
        self.pinned_training: set[str] = set()
        """Cells an explicit flip sent to training: the planner does not flip them back."""
        self.role_sent: dict[str, tuple[str, float]] = {}
        """cell → (flip id, monotonic time) of the last `set_role` sent to it."""
        self._align_sweep = ctx.registry.rotation()
        """The live cells `align_roles` visits next."""
        self.job_floor: Callable[[str, set[str] | None], str | None] | None = None  # jobfloor.py
        self.slices = DrainSlices(ctx, ownership, snapshot)
        """The tick's budget of moves out of draining cells."""

    # ------------------------------------------------------------------ requests for flips
    def request(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
                idempotency_key: str | None = None, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        """An explicit flip (POST /v1/flips), overriding the planner until an explicit flip back;
        `exclude`: cells a flip by count never picks (another RL job's, for a job-bound trainer)."""
        out = self.create(to, cell, count, expected_generation, idempotency_key, exclude)
        for f in out.get("flips", []):
            if to == "training":
                self.pinned_training.add(f["cell"])
            else:
                self.pinned_training.discard(f["cell"])
        return out

    def create(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
               idempotency_key: str | None = None, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Record flips durably (pending); the loop carries them out. Replays of an
        Idempotency-Key return the original answer; a key reused with another body is a 409."""
        ctx = self.ctx
        fp = idempotency.fingerprint([to, cell, count, expected_generation])
        hit = idempotency.replay(ctx.store, IDEMPOTENCY_SCOPE, idempotency_key, fp)
        if hit is not None:
            return hit
        with ctx.txn(durable=True):
            response = self._record(to, cell, count, expected_generation, idempotency_key, fp, exclude)
        failpoint("flip.after_record")  # recorded durably, nothing done yet: a restart must carry it out
        ctx.kick()
        return response

    def _record(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
                key: str | None, fp: str, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        """In the caller's transaction: the flips' rows and the answer for replays (a refusal raises first)."""
        made = [self._new_flip(c, to, key) for c in self._targets(to, cell, count, expected_generation, exclude)]
        response = {"id": made[0].id, "state": made[0].state,
                    "flips": [{"id": f.id, "cell": f.cell_id, "state": f.state} for f in made]}
        idempotency.record(self.ctx.store, IDEMPOTENCY_SCOPE, key, fp, response)
        return response

    def _targets(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
                 exclude: frozenset[str] = frozenset()) -> list[CellRow]:
        fleet = self.ctx.store.fleet
        if cell is not None:
            row = fleet.get_cell(cell)
            if row is None:
                raise NotFound(f"unknown cell {cell!r}")
            if expected_generation is not None and expected_generation != row.generation:
                raise Conflict(f"cell {cell} is at generation {row.generation}, not {expected_generation}",
                               code="stale_generation")
            return [row]
        want = count or 1
        flipping = fleet.flipping_cells() | exclude  # not to pick: it would be refused
        ids = placement.choose_cells_to_flip(self.snapshot(), to, want, flipping, self.ownership.kept_placement())
        if len(ids) < want:
            raise Conflict(f"only {len(ids)} cells can flip to {to}, {want} asked", code="no_cells")
        return [fleet.get_cell(i) for i in ids]  # type: ignore[misc]

    def _new_flip(self, cell: CellRow, to: str, key: str | None) -> FlipRow:
        fleet, min_rollout = self.ctx.store.fleet, self.ctx.cfg.min_rollout_cells
        if fleet.active_flip_for(cell.id) is not None:
            raise Conflict(f"cell {cell.id} already has a flip in progress", code="flip_in_progress")
        need = "rollout" if to == "training" else "training"
        if cell.state != need:
            raise Conflict(f"cell {cell.id} is {cell.state}; a flip to {to} needs {need}", code="illegal_transition")
        if to == "training" and not self._spare_rollout(cell.id, need=min_rollout):
            why = self.job_floor(cell.id, None) if self.job_floor is not None else None
            raise Conflict(why or f"flipping {cell.id} would leave fewer than {min_rollout} rollout cells", code="min_rollout_cells")
        now = time.time()
        flip = FlipRow(f"flip-{uuid.uuid4().hex[:16]}", cell.id, to, "pending", key, created_at=now)
        flip.history.append(("pending", now, f"{cell.id} to {to}"))
        fleet.put_flip(flip)
        return flip

    def get(self, flip_id: str) -> dict[str, Any]:
        row = self.ctx.store.fleet.get_flip(flip_id)
        if row is None:
            raise NotFound(f"unknown flip {flip_id!r}")
        return row.to_api()

    def _spare_rollout(self, exclude: str, leaving: set[str] | None = None, need: int = 1) -> bool:
        """Whether `need` verified rollout cells stay (live, rollout, not flipping to training: the tally's
        set, brought up to date; trusted, `Trust.counts`; counting stops at `need`). `leaving`: the cells
        flipping to training, if known (a superset is safe). `job_floor`: the cell's RL job's own floor."""
        if self.job_floor is not None and self.job_floor(exclude, leaving) is not None:
            return False
        if need <= 0:
            return True
        if leaving is None:
            leaving = self.ctx.store.fleet.flipping_cells("training")
        self.tally.advance(self.ctx.clock())
        away, found = leaving | {exclude}, 0
        for c in self.tally.rollout:
            if c not in away and self.trust.counts(c):
                found += 1
                if found >= need:
                    return True
        return False

    def finish(self, fx: Effects, flip: FlipRow, outcome: str, reason: str | None = None) -> None:
        """pending/draining/loading → done | failed | rolled_back (caller saved the cell)."""
        metrics = self.ctx.metrics
        set_state(FLIP, flip, outcome, reason or "")
        flip.reason, flip.finished_at = reason, time.time()
        self.ctx.store.fleet.put_flip(flip)
        self.drain_deadline.pop(flip.id, None)
        self.load_deadline.pop(flip.id, None)
        duration = flip.finished_at - flip.created_at
        fx.later(lambda: metrics.flips.labels(outcome).inc())
        fx.later(lambda: metrics.flip_duration.observe(max(0.0, duration)))

    # ------------------------------------------------------------------ the loop's side
    def step(self) -> None:
        """Advance every unfinished flip by one level-triggered step, all in one transaction:
        one durable commit a tick (a burst of a hundred flips paid a hundred fsyncs, ~0.3 s of
        held event loop). Should one flip's step raise, all roll back and are stepped again
        one transaction each (the one that raises then stops only those after it)."""
        flips = self.ctx.store.fleet.list_flips(active_only=True)
        if not flips:
            return
        self.slices.begin_tick()
        sent = dict(self.role_sent)
        try:
            with self.ctx.txn(durable=True) as fx:
                self._advance_all(flips, lambda flip, leaving: self._advance(fx, flip, leaving))
        except Exception:
            log.exception("stepping the flips together failed: stepping them one by one")
            self.role_sent = sent  # the set_role commands of the rolled-back steps were never sent
            self.slices.begin_tick()  # their moves were rolled back too
            flips = self.ctx.store.fleet.list_flips(active_only=True)
            self._advance_all(flips, self._advance_alone)

    def _advance_all(self, flips: list[FlipRow], advance: Callable[[FlipRow, set[str]], None]) -> None:
        # read once a step (a step starts no flip): a flip that ends here leaves it at once
        leaving = {f.cell_id for f in flips if f.to_role == "training"}
        for flip in flips:
            advance(flip, leaving)
            if FLIP.is_terminal(flip.state):
                leaving.discard(flip.cell_id)

    def _advance_alone(self, flip: FlipRow, leaving: set[str]) -> None:
        with self.ctx.txn(durable=True) as fx:
            self._advance(fx, flip, leaving)

    def _advance(self, fx: Effects, flip: FlipRow, leaving: set[str]) -> None:
        cell = self.ctx.store.fleet.get_cell(flip.cell_id)
        if cell is None or cell.state == "down":
            self.finish(fx, flip, "failed", "cell lost")
            return
        if flip.state == "pending":
            self._begin(fx, flip, cell, leaving)
        if flip.state == "draining":
            self._drain(fx, flip, cell, leaving)
        elif flip.state == "loading":
            self._load(fx, flip, cell)

    def _begin(self, fx: Effects, flip: FlipRow, cell: CellRow, leaving: set[str]) -> None:
        need = "rollout" if flip.to_role == "training" else "training"
        if cell.state != need:
            self.finish(fx, flip, "failed", f"cell is {cell.state}, not {need}")
        elif flip.to_role == "training" and not self._spare_rollout(cell.id, leaving, self.ctx.cfg.min_rollout_cells):
            self.finish(fx, flip, "failed", "would leave fewer than min_rollout_cells rollout cells")
        else:
            nxt = "draining" if flip.to_role == "training" else "loading"
            self._set_cell(cell, nxt, f"flip {flip.id}")
            set_state(FLIP, flip, nxt)
            self.ctx.store.fleet.put_flip(flip)

    def _set_cell(self, cell: CellRow, state: str, detail: str) -> None:
        set_state(CELL, cell, state, detail)
        cell.generation += 1
        self.ctx.store.fleet.put_cell(cell)
        self.slices.invalidate()  # no slice of this step places a request by the cell's old state

    def _drain(self, fx: Effects, flip: FlipRow, cell: CellRow, leaving: set[str]) -> None:
        """Draining: migrate its requests out, a slice a tick (`drains.py`); at the deadline park
        or suspend what is left; once empty (and the final scoring pass done) hand the cell the
        training role."""
        ctx = self.ctx
        now = ctx.clock()
        deadline = self.drain_deadline.setdefault(flip.id, now + ctx.cfg.drain_deadline_s)
        owners = ctx.store.owners
        if not self._spare_rollout(cell.id, leaving, ctx.cfg.min_rollout_cells):
            self._roll_back_drain(fx, flip, cell, owners.requests_on(cell.id))
            return
        # its requests are read only when this step acts on them: a drain waiting for the
        # tick's move budget reads one kept count (a hundred waiting drains read ~10k rows)
        if owners.load_of(cell.id)[0]:
            if now >= deadline:
                self.slices.suspend_at_deadline(fx, flip, cell, owners.requests_on(cell.id))
            else:
                if self.slices.moves_left > 0:  # a slice a tick: the rest wait their turn
                    self.slices.migrate_out(fx, flip, cell, owners.requests_on(cell.id))
                return
        if self.scoring.sole_holder_with_backlog(cell.id) and now < deadline + ctx.cfg.drain_deadline_s:
            return  # the final pass: tokens only this cell can score exactly, before it drops its weights
        self._hand_over(fx, flip, cell)

    def _hand_over(self, fx: Effects, flip: FlipRow, cell: CellRow) -> None:
        """The cell is empty: done once it reports the training role, else tell it the role."""
        if self._reported_role(cell.id) == "training":
            self._set_cell(cell, "training", f"flip {flip.id} done")
            self.finish(fx, flip, "done")
        else:
            self._send_role(fx, cell.id, "training", flip.id, None)

    def _roll_back_drain(self, fx: Effects, flip: FlipRow, cell: CellRow, live: list[RequestRow]) -> None:
        for req in live:
            if (m := self.migrations.pending_for(req.id)) is not None:
                self.migrations.abort(fx, m, "flip rolled back", tell=(m.src, m.dst))
        self._set_cell(cell, "rollout", f"flip {flip.id} rolled back")
        self.finish(fx, flip, "rolled_back", "rollout capacity fell under min_rollout_cells")

    def _load(self, fx: Effects, flip: FlipRow, cell: CellRow) -> None:
        """Loading: the cell fetches the target version (Versions.catch_up tells it), then takes
        the rollout role serving it."""
        if self._reported_role(cell.id) == "rollout":
            self._set_cell(cell, "rollout", f"flip {flip.id} done")
            self.finish(fx, flip, "done")
            return
        want = self.versions.target(self.versions.lineages.job_of_cell(cell.id))  # the cell's RL job's
        summary = self.ctx.registry.summary(cell.id)
        have = summary.version if summary is not None else None
        if want is not None and have != want.v:
            limit = self.ctx.ver_cfg.load_deadline_s
            if self.ctx.clock() >= self.load_deadline.setdefault(flip.id, self.ctx.clock() + limit):
                # never stuck in loading: the cell keeps the training role, the trainer sees why
                self._set_cell(cell, "training", f"flip {flip.id} rolled back")
                self.finish(fx, flip, "rolled_back", f"version {want.v} not loaded within {limit:g}s")
            return  # still fetching it
        self._send_role(fx, cell.id, "rollout", flip.id, have)

    def _reported_role(self, cell_id: str) -> str | None:
        summary = self.ctx.registry.summary(cell_id)
        return summary.role if summary is not None else None

    def _send_role(self, fx: Effects, cell_id: str, role: str, flip_id: str, version: int | None) -> bool:
        """set_role is idempotent on the cell; resend it once per lease until the cell reports
        the role. True when it was sent now."""
        now = self.ctx.clock()
        last_flip, last_at = self.role_sent.get(cell_id, ("", float("-inf")))
        if cell_id not in self.ctx.registry.live or (last_flip == flip_id and now - last_at < self.ctx.cfg.lease_s):
            return False
        self.role_sent[cell_id] = (flip_id, now)
        host = training_host(self.ctx.store, cell_id) if role == "training" else None
        fx.send(cell_id, lambda i: SetRoleCmd(i, role, flip_id, version, host))
        return True

    def align_roles(self) -> None:
        """Level-triggered: a live cell with no flip under way that reports a role other than
        the one the store gives it is told its role again (once per lease). The two drift
        apart when a flip is rolled back after its `set_role` went out (a drain whose rollout
        capacity fell under the minimum just as the cell emptied): the cell took the training
        role, the store keeps it in rollout, and a request placed there would sit undecoded
        while the cell still reports it. Visits the live cells a slice a tick (`Registry.rotation`)."""
        flipping = self.ctx.store.fleet.flipping_cells()
        self.tally.advance(self.ctx.clock())
        cells = self.tally.cells
        for cell_id in self._align_sweep.next():
            kept = cells.get(cell_id)
            state = kept.state if kept is not None else None
            reported = self._reported_role(cell_id)
            if cell_id in flipping or state not in ("rollout", "training") or reported is None or reported == state:
                continue
            with self.ctx.txn(durable=False) as fx:
                summary = self.ctx.registry.summary(cell_id)
                version = summary.version if summary is not None and state == "rollout" else None
                if self._send_role(fx, cell_id, state, ALIGN_FLIP_ID, version):
                    log.warning("cell %s reports the %s role, the store has it in %s: restating it", cell_id,
                                reported, state)

    def role_failed(self, fx: Effects, cell_id: str, flip_id: str, reason: str) -> None:
        """The cell could not take the role: roll the flip back to the role it had."""
        fleet = self.ctx.store.fleet
        flip, cell = fleet.get_flip(flip_id), fleet.get_cell(cell_id)
        if flip is None or cell is None or flip.cell_id != cell_id or FLIP.is_terminal(flip.state):
            return
        back = {"loading": "training", "draining": "rollout"}.get(cell.state)
        if back is not None and flip.state in ("draining", "loading"):
            self._set_cell(cell, back, f"flip {flip_id} failed on the cell: {reason}")
            self.finish(fx, flip, "rolled_back", reason or "the cell could not take the role")

    def autonomous(self, snap: Snapshot | None = None) -> None:
        """The planner's own flips (when `auto_flip`) on `snap` (one RL job's; None: the fleet's),
        as if POSTed without a key, in one transaction (one durable commit for a burst of flips)."""
        plan = placement.plan_flips(snap) if snap else placement.plan_flips(self.snapshot(), self.ownership.kept_placement())
        if not plan:
            return
        made = 0
        with self.ctx.txn(durable=True):
            for cell_id, to in plan:
                try:
                    self._record(to, cell_id, None, None, None, "")
                except (Conflict, NotFound):
                    continue  # the planner's view was older than the store's; it decides again next tick
                made += 1
        if made:
            failpoint("flip.after_record")  # recorded durably, nothing done yet
            self.ctx.kick()

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None:
        """The cell's flip under way fails; an explicit pin of its old incarnation lapses."""
        flip = self.ctx.store.fleet.active_flip_for(cell_id)
        if flip is not None:
            self.finish(fx, flip, "failed", f"cell lost: {reason}")
        self.pinned_training.discard(cell_id)
        self.role_sent.pop(cell_id, None)

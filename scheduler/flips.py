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
from typing import TYPE_CHECKING, Any

from scheduler import idempotency, migrations, ownership, placement, scoring, versions
from scheduler.errors import Conflict, NotFound
from scheduler.failpoints import failpoint
from scheduler.protocol import SetRoleCmd
from scheduler.states import CELL, FLIP, set_state
from scheduler.store.fleet import CellRow, FlipRow

if TYPE_CHECKING:
    from scheduler.controller import Controller, Effects

log = logging.getLogger("cellflip.scheduler")

IDEMPOTENCY_SCOPE = "flips"


def create(ctl: Controller, to: str, cell: str | None, count: int | None, expected_generation: int | None,
           idempotency_key: str | None = None) -> dict[str, Any]:
    """Record flips durably (pending); the loop carries them out. Replays of an
    Idempotency-Key return the original answer; a key reused with another body is a 409."""
    fp = idempotency.fingerprint([to, cell, count, expected_generation])
    hit = idempotency.replay(ctl, IDEMPOTENCY_SCOPE, idempotency_key, fp)
    if hit is not None:
        return hit
    with ctl.txn(durable=True):
        if cell is not None:
            row = ctl.store.fleet.get_cell(cell)
            if row is None:
                raise NotFound(f"unknown cell {cell!r}")
            if expected_generation is not None and expected_generation != row.generation:
                raise Conflict(f"cell {cell} is at generation {row.generation}, not {expected_generation}",
                               code="stale_generation")
            targets = [row]
        else:
            want = count or 1
            ids = placement.choose_cells_to_flip(ctl.snapshot(), to, want)
            if len(ids) < want:
                raise Conflict(f"only {len(ids)} cells can flip to {to}, {want} asked", code="no_cells")
            targets = [ctl.store.fleet.get_cell(i) for i in ids]  # type: ignore[misc]
        made = [_new_flip(ctl, c, to, idempotency_key) for c in targets]
        response = {"id": made[0].id, "state": made[0].state,
                    "flips": [{"id": f.id, "cell": f.cell_id, "state": f.state} for f in made]}
        idempotency.record(ctl, IDEMPOTENCY_SCOPE, idempotency_key, fp, response)
    failpoint("flip.after_record")  # recorded durably, nothing done yet: a restart must carry it out
    ctl.kick()
    return response


def _new_flip(ctl: Controller, cell: CellRow, to: str, key: str | None) -> FlipRow:
    if ctl.store.fleet.active_flip_for(cell.id) is not None:
        raise Conflict(f"cell {cell.id} already has a flip in progress", code="flip_in_progress")
    need = "rollout" if to == "training" else "training"
    if cell.state != need:
        raise Conflict(f"cell {cell.id} is {cell.state}; a flip to {to} needs {need}", code="illegal_transition")
    if to == "training" and _spare_rollout(ctl, exclude=cell.id) < ctl.cfg.min_rollout_cells:
        raise Conflict(f"flipping {cell.id} would leave fewer than {ctl.cfg.min_rollout_cells} rollout cells",
                       code="min_rollout_cells")
    now = time.time()
    flip = FlipRow(f"flip-{uuid.uuid4().hex[:16]}", cell.id, to, "pending", key, created_at=now)
    flip.history.append(("pending", now, f"{cell.id} to {to}"))
    ctl.store.fleet.put_flip(flip)
    return flip


def _spare_rollout(ctl: Controller, exclude: str) -> int:
    """Rollout cells that stay in rollout: live, in state rollout, not flipping to training."""
    leaving = {f.cell_id for f in ctl.store.fleet.list_flips(active_only=True) if f.to_role == "training"}
    return sum(1 for c in ctl.store.fleet.list_cells()
               if c.state == "rollout" and c.id != exclude and c.id not in leaving and c.id in ctl.registry.live)


def finish(ctl: Controller, fx: Effects, flip: FlipRow, outcome: str, reason: str | None = None) -> None:
    """pending/draining/loading → done | failed | rolled_back (caller saved the cell)."""
    set_state(FLIP, flip, outcome, reason or "")
    flip.reason, flip.finished_at = reason, time.time()
    ctl.store.fleet.put_flip(flip)
    ctl.drain_deadline.pop(flip.id, None)
    duration = flip.finished_at - flip.created_at
    fx.later(lambda: ctl.metrics.flips.labels(outcome).inc())
    fx.later(lambda: ctl.metrics.flip_duration.observe(max(0.0, duration)))


def step(ctl: Controller) -> None:
    """Advance every unfinished flip by one level-triggered step."""
    for flip in ctl.store.fleet.list_flips(active_only=True):
        with ctl.txn(durable=True) as fx:
            cell = ctl.store.fleet.get_cell(flip.cell_id)
            if cell is None or cell.state == "down":
                finish(ctl, fx, flip, "failed", "cell lost")
                continue
            if flip.state == "pending":
                _begin(ctl, fx, flip, cell)
            if flip.state == "draining":
                _drain(ctl, fx, flip, cell)
            elif flip.state == "loading":
                _load(ctl, fx, flip, cell)


def _begin(ctl: Controller, fx: Effects, flip: FlipRow, cell: CellRow) -> None:
    need = "rollout" if flip.to_role == "training" else "training"
    if cell.state != need:
        finish(ctl, fx, flip, "failed", f"cell is {cell.state}, not {need}")
    elif flip.to_role == "training" and _spare_rollout(ctl, exclude=cell.id) < ctl.cfg.min_rollout_cells:
        finish(ctl, fx, flip, "failed", "would leave fewer than min_rollout_cells rollout cells")
    else:
        nxt = "draining" if flip.to_role == "training" else "loading"
        _set_cell(ctl, cell, nxt, f"flip {flip.id}")
        set_state(FLIP, flip, nxt)
        ctl.store.fleet.put_flip(flip)


def _set_cell(ctl: Controller, cell: CellRow, state: str, detail: str) -> None:
    set_state(CELL, cell, state, detail)
    cell.generation += 1
    ctl.store.fleet.put_cell(cell)


def _drain(ctl: Controller, fx: Effects, flip: FlipRow, cell: CellRow) -> None:
    now = ctl.clock()
    deadline = ctl.drain_deadline.setdefault(flip.id, now + ctl.cfg.drain_deadline_s)
    live = ctl.store.owners.requests_on(cell.id)
    if _spare_rollout(ctl, exclude=cell.id) < ctl.cfg.min_rollout_cells:
        for req in live:
            if (m := ctl.store.owners.pending_migration_for(req.id)) is not None:
                migrations.abort_in_tx(ctl, fx, m, "flip rolled back", tell=(m.src, m.dst))
        _set_cell(ctl, cell, "rollout", f"flip {flip.id} rolled back")
        finish(ctl, fx, flip, "rolled_back", "rollout capacity fell under min_rollout_cells")
        return
    if live and now >= deadline:
        park = ctl.mig_cfg.park_on_deadline and bool(cell.capabilities.get("kv_export"))
        for req in live:
            if park:
                ownership.park(ctl, fx, req, f"drain deadline of flip {flip.id}")
            else:
                ownership.revoke(ctl, fx, req, f"drain deadline of flip {flip.id}", to="suspended")
            flip.suspended += 1
        ctl.store.fleet.put_flip(flip)
        live = []
    if live:
        snapshot = ctl.snapshot()
        for req in live:
            if req.state != "running":
                continue
            choice = placement.choose_destination(snapshot, cell.id, ownership.summarize(ctl, req))
            dst = ctl.store.fleet.get_cell(choice.cell_id) if choice is not None else None
            if dst is None:
                continue  # no room now; retried next tick, suspended at the deadline
            hint = "reprefill" if ctl.mig_cfg.path == "reprefill" else choice.path
            migrations.start(ctl, fx, req, cell, dst, flip, hint)
            snapshot = ownership.bump(snapshot, dst.id)
        ctl.store.fleet.put_flip(flip)
        return
    if scoring.sole_holder_with_backlog(ctl, cell.id) and now < deadline + ctl.cfg.drain_deadline_s:
        return  # the final pass: tokens only this cell can score exactly, before it drops its weights
    if _reported_role(ctl, cell.id) == "training":
        _set_cell(ctl, cell, "training", f"flip {flip.id} done")
        finish(ctl, fx, flip, "done")
    else:
        _send_role(ctl, fx, cell.id, "training", flip.id, None)


def _load(ctl: Controller, fx: Effects, flip: FlipRow, cell: CellRow) -> None:
    """Loading: the cell fetches the target version (versions.catch_up tells it), then takes
    the rollout role serving it."""
    if _reported_role(ctl, cell.id) == "rollout":
        _set_cell(ctl, cell, "rollout", f"flip {flip.id} done")
        finish(ctl, fx, flip, "done")
        return
    want = versions.target(ctl)
    entry = ctl.registry.live.get(cell.id)
    have = entry.summary.version if entry is not None and entry.summary is not None else None
    if want is not None and have != want.v:
        return  # still fetching it
    _send_role(ctl, fx, cell.id, "rollout", flip.id, have)


def _reported_role(ctl: Controller, cell_id: str) -> str | None:
    entry = ctl.registry.live.get(cell_id)
    return entry.summary.role if entry is not None and entry.summary is not None else None


def _send_role(ctl: Controller, fx: Effects, cell_id: str, role: str, flip_id: str, version: int | None) -> bool:
    """set_role is idempotent on the cell; resend it once per lease until the cell reports the
    role. True when it was sent now."""
    entry = ctl.registry.live.get(cell_id)
    now = ctl.clock()
    if entry is None or (entry.role_sent[0] == flip_id and now - entry.role_sent[1] < ctl.cfg.lease_s):
        return False
    entry.role_sent = (flip_id, now)
    fx.send(cell_id, lambda i: SetRoleCmd(i, role, flip_id, version))
    return True


ALIGN_FLIP_ID = "align"
"""The flip id of a `set_role` that restates a settled role (no flip is under way)."""


def align_roles(ctl: Controller) -> None:
    """Level-triggered: a live cell with no flip under way that reports a role other than the
    one the store gives it is told its role again (once per lease). The two drift apart when
    a flip is rolled back after its `set_role` went out (a drain whose rollout capacity fell
    under the minimum just as the cell emptied): the cell took the training role, the store
    keeps it in rollout, and a request placed there would sit undecoded while the cell still
    reports it."""
    flipping = {f.cell_id for f in ctl.store.fleet.list_flips(active_only=True)}
    for cell_id, state in ctl.store.fleet.cell_states().items():
        reported = _reported_role(ctl, cell_id)
        if cell_id in flipping or state not in ("rollout", "training") or reported is None or reported == state:
            continue
        with ctl.txn(durable=False) as fx:
            entry = ctl.registry.live.get(cell_id)
            version = entry.summary.version if entry is not None and entry.summary is not None else None
            if _send_role(ctl, fx, cell_id, state, ALIGN_FLIP_ID, version if state == "rollout" else None):
                log.warning("cell %s reports the %s role, the store has it in %s: restating it", cell_id,
                            reported, state)


def role_failed(ctl: Controller, fx: Effects, cell_id: str, flip_id: str, reason: str) -> None:
    """The cell could not take the role: roll the flip back to the role it had."""
    flip = ctl.store.fleet.get_flip(flip_id)
    cell = ctl.store.fleet.get_cell(cell_id)
    if flip is None or cell is None or flip.cell_id != cell_id or FLIP.is_terminal(flip.state):
        return
    back = {"loading": "training", "draining": "rollout"}.get(cell.state)
    if back is not None and flip.state in ("draining", "loading"):
        _set_cell(ctl, cell, back, f"flip {flip_id} failed on the cell: {reason}")
        finish(ctl, fx, flip, "rolled_back", reason or "the cell could not take the role")


def autonomous(ctl: Controller) -> None:
    """The planner's own flips (when `auto_flip`), as if POSTed without a key."""
    for cell_id, to in placement.plan_flips(ctl.snapshot()):
        try:
            create(ctl, to, cell_id, None, None)
        except (Conflict, NotFound):
            continue  # the planner's view was older than the store's; it decides again next tick

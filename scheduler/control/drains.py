"""A draining cell's requests leave it a slice a tick.

    begin_tick()                                  the tick's move budget, fresh
    invalidate()                                  a cell changed state: the next slice re-reads
    migrate_out(fx, flip, cell, live)             up to the budget's moves, placed in one pass
    suspend_at_deadline(fx, flip, cell, live)     park (or suspend) what is left at the deadline

A burst of flips used to move every running request of every draining cell in the tick that
found it (~0.45 ms of SQL per moved request: a hundred draining cells held the loop for a
second). Each tick now starts at most `DRAIN_MOVES_PER_TICK` moves over all the drains, in the
flips' order; the rest stay where they are and are placed by a later tick. Every slice keeps the
drain's invariants: a request not moved yet is still owned by its draining cell (same owner,
same epoch: fenced as before), running and counted there, so the planner's snapshot sees it on
the source and nothing is lost; a moved one is owned by its destination (or pending as a KV copy
counted there as incoming) in the same transaction as its move. The slices are placed on one
snapshot a step (`choose_destinations` on the kept placement index, which each placement uses
up, so later slices see the room earlier ones took), built again only when a cell changed its
state in the step (a flip began, ended or rolled back: `invalidate`) — a hundred nearly drained
cells moving one request each used to build a hundred; nothing is planned ahead in memory, so a
restarted scheduler continues the drain from the store alone. At the drain deadline what is
left is parked or suspended as before, whatever the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.planner import placement

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.ownership import Ownership
    from scheduler.planner.types import Snapshot
    from scheduler.store.fleet import CellRow, FlipRow
    from scheduler.store.owners import RequestRow

DRAIN_MOVES_PER_TICK = 32
"""Moves out of draining cells a tick starts at most, over all its drains: at ~0.1 ms each (the
owner's revoke and assign, the migration record; bench/scheduler_scale.py at 10,000 cells) ~3 ms
of a tick; 160 requests a second at 5 ticks a second, a 128-request cell drained in under a
second."""


class DrainSlices:
    """The tick's budget of moves out of draining cells. Owns `moves_left`."""

    def __init__(self, ctx: Context, ownership: Ownership, snapshot: Callable[[], Snapshot],
                 per_tick: int = DRAIN_MOVES_PER_TICK) -> None:
        self.ctx = ctx
        self.ownership = ownership
        self.snapshot = snapshot
        self.per_tick = per_tick
        self.moves_left = per_tick
        """Moves this tick may still start (`begin_tick` fills it)."""
        self._snap: Snapshot | None = None
        """The step's snapshot, while no cell changed state since it was built."""

    def begin_tick(self) -> None:
        self.moves_left = self.per_tick
        self._snap = None

    def invalidate(self) -> None:
        """A cell changed state (draining, training, rollout): the next slice builds a snapshot."""
        self._snap = None

    def migrate_out(self, fx: Effects, flip: FlipRow, cell: CellRow, live: list[RequestRow]) -> int:
        """Up to the tick's budget of the draining cell's running requests to a destination,
        placed in one pass (`choose_destinations`: O(moves log cells)); returns the moves
        started. Those left stay running on the cell, its own, for a later tick."""
        running = [req for req in live if req.state == "running"]
        if not running or self.moves_left <= 0:
            return 0
        running = running[:self.moves_left]
        ctx = self.ctx
        if self._snap is None:
            self._snap = self.snapshot()
        choices = placement.choose_destinations(self._snap, cell.id,
                                                [self.ownership.summarize(req) for req in running],
                                                only=ctx.placeable(None, cell.id),  # the cell's job's
                                                placement=self.ownership.kept_placement())  # after snapshot()
        moved = 0
        for req, choice in zip(running, choices, strict=True):
            dst = ctx.store.fleet.get_cell(choice.cell_id) if choice is not None else None
            if dst is None:
                continue  # no room now; retried next tick, parked or suspended at the deadline
            hint = "reprefill" if ctx.mig_cfg.path == "reprefill" else choice.path
            self.ownership.move(fx, req, cell, dst, flip, hint)
            moved += 1
        self.moves_left -= moved
        ctx.store.fleet.put_flip(flip)
        return moved

    def suspend_at_deadline(self, fx: Effects, flip: FlipRow, cell: CellRow, live: list[RequestRow]) -> None:
        """The drain deadline passed: park what is left (its KV to the cell's host memory, the
        cell still its owner), or suspend it for a re-prefill elsewhere."""
        park = self.ctx.mig_cfg.park_on_deadline and bool(cell.capabilities.get("kv_export"))
        for req in live:
            if park:
                self.ownership.park(fx, req, f"drain deadline of flip {flip.id}")
            else:
                self.ownership.revoke(fx, req, f"drain deadline of flip {flip.id}", to="suspended")
            flip.suspended += 1
        self.ctx.store.fleet.put_flip(flip)

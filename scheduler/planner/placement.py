"""The control plane's one door to the planner (scheduler/planner/plan.py): the planner's own
`Snapshot` in, decisions out.

scheduler/control/snapshot.py builds the `Snapshot` (every field the cluster simulator fills). These
helpers turn the planner's answers into the string cell ids the concerns use, with None for
"nowhere", and add the one rule the planner does not make: a later turn of a session goes back
to the cell that served its earlier turns when that cell has room (`sticky_destination`).
Nothing here mutates anything but the room given away in the `Placement` a caller passes
(`placement=`: the controller's kept index, scheduler/planner/room.py); without one each call
builds a fresh index from the snapshot and is pure.
"""

from __future__ import annotations

from collections.abc import Container
from collections.abc import Set as AbstractSet

from scheduler.planner import destinations
from scheduler.planner import plan as planner
from scheduler.planner.room import Placement, placement_for
from scheduler.planner.types import Destination, RequestSummary, Snapshot

__all__ = ["choose_cells_to_flip", "choose_destination", "choose_destinations", "plan_flips", "sticky_destination"]


def choose_destination(snapshot: Snapshot, source_cell_id: str | None, request: RequestSummary,
                       only: Container[str] | None = None, placement: Placement | None = None) -> Destination | None:
    """A rollout cell with room for `request` and the planner's path (None: nowhere).
    `source_cell_id` None places a new or waiting request; `only`: the cells that may take it
    (its job's, on a fleet shared by several jobs; None: any); `placement`: the index whose
    room it uses up (None: a fresh one)."""
    return choose_destinations(snapshot, source_cell_id, [request], only=only, placement=placement)[0]


def choose_destinations(snapshot: Snapshot, source_cell_id: str | None, requests: list[RequestSummary],
                        in_order: bool = False, only: Container[str] | None = None,
                        placement: Placement | None = None) -> list[Destination | None]:
    """Where each of `requests` leaving `source_cell_id` (None: waiting ones) goes (None:
    nowhere now), placed in one pass over the fleet: earlier placements use up room for later
    ones; `in_order` places them in the given order (else larger contexts first); never on a
    cell outside `only` when given; on `placement` when given (its room used up there)."""
    return [None if d.cell_id is None else Destination(str(d.cell_id), d.path, d.seconds)
            for d in destinations.choose_destinations(snapshot, [(source_cell_id, r) for r in requests],
                                                      in_order=in_order, only=only, placement=placement)]


def sticky_destination(snapshot: Snapshot, cell_id: str | None, request: RequestSummary,
                       only: Container[str] | None = None, placement: Placement | None = None) -> Destination | None:
    """The session's previous cell when it can take the request: a later turn then reuses the
    KV its earlier turns left in that cell's prefix cache (path "kv": nothing moves). None
    when it has no room, or is outside `only` (it moved to another job); the caller then takes
    the planner's choice (`choose_destination`)."""
    if cell_id is None or (only is not None and cell_id not in only):
        return None
    c = placement_for(snapshot, placement).room_for(cell_id, request.context_tokens)
    return None if c is None else Destination(c.cell_id, "kv")


def choose_cells_to_flip(snapshot: Snapshot, to: str, count: int, exclude: AbstractSet[str] = frozenset(),
                         placement: Placement | None = None) -> list[str]:
    """Up to `count` cells to flip `to` a role, never dipping under min_rollout_cells; cells in
    `exclude` (a flip under way) are neither picked nor counted."""
    return [str(c) for c in planner.choose_cells_to_flip(snapshot, to, count, exclude=exclude,  # type: ignore[arg-type]
                                                         placement=placement)]


def plan_flips(snapshot: Snapshot, placement: Placement | None = None) -> list[tuple[str, str]]:
    """The planner's autonomous flips as (cell_id, to)."""
    return [(str(d.cell_id), d.to) for d in planner.plan_flips(snapshot, placement=placement)]

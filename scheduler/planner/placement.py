"""The control plane's one door to the planner (scheduler/planner/plan.py): the planner's own
`Snapshot` in, decisions out.

scheduler/control/snapshot.py builds the `Snapshot` (every field the cluster simulator fills). These
helpers turn the planner's answers into the string cell ids the concerns use, with None for
"nowhere", and add the one rule the planner does not make: a later turn of a session goes back
to the cell that served its earlier turns when that cell has room (`sticky_destination`).
Nothing here mutates anything but the room a snapshot's kept placement index gives away
(scheduler/planner/destinations.py `Placement`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from collections.abc import Set as AbstractSet

from scheduler.planner import destinations
from scheduler.planner import plan as planner
from scheduler.planner.types import Destination, RequestSummary, Snapshot

__all__ = ["choose_cells_to_flip", "choose_destination", "choose_destinations", "plan_flips", "sticky_destination",
           "with_placement"]


def choose_destination(snapshot: Snapshot, source_cell_id: str | None,
                       request: RequestSummary, only: Container[str] | None = None) -> Destination | None:
    """A rollout cell with room for `request` and the planner's path (None: nowhere).
    `source_cell_id` None places a new or waiting request; `only`: the cells that may take it
    (its job's, on a fleet shared by several jobs; None: any)."""
    return choose_destinations(snapshot, source_cell_id, [request], only=only)[0]


def choose_destinations(snapshot: Snapshot, source_cell_id: str | None, requests: list[RequestSummary],
                        in_order: bool = False, only: Container[str] | None = None) -> list[Destination | None]:
    """Where each of `requests` leaving `source_cell_id` (None: waiting ones) goes (None:
    nowhere now), placed in one pass over the fleet: earlier placements use up room for later
    ones; `in_order` places them in the given order (else larger contexts first); never on a
    cell outside `only` when given."""
    return [None if d.cell_id is None else Destination(str(d.cell_id), d.path, d.seconds)
            for d in destinations.choose_destinations(snapshot, [(source_cell_id, r) for r in requests],
                                                      in_order=in_order, only=only)]


def sticky_destination(snapshot: Snapshot, cell_id: str | None,
                       request: RequestSummary, only: Container[str] | None = None) -> Destination | None:
    """The session's previous cell when it can take the request: a later turn then reuses the
    KV its earlier turns left in that cell's prefix cache (path "kv": nothing moves). None
    when it has no room, or is outside `only` (it moved to another job); the caller then takes
    the planner's choice (`choose_destination`)."""
    if cell_id is None or (only is not None and cell_id not in only):
        return None
    c = destinations.placement_of(snapshot).room_for(cell_id, request.context_tokens)
    return None if c is None else Destination(c.cell_id, "kv")


def with_placement(snapshot: Snapshot) -> Snapshot:
    """The snapshot with a placement index (its kept one, else a fresh one): placements on it
    use up room for the later ones (several decisions within one tick)."""
    if snapshot.placement is not None:
        return snapshot
    return dataclasses.replace(snapshot, placement=destinations.Placement(snapshot.cells))


def choose_cells_to_flip(snapshot: Snapshot, to: str, count: int, exclude: AbstractSet[str] = frozenset()) -> list[str]:
    """Up to `count` cells to flip `to` a role, never dipping under min_rollout_cells; cells in
    `exclude` (a flip under way) are neither picked nor counted."""
    return [str(c) for c in planner.choose_cells_to_flip(snapshot, to, count, exclude=exclude)]  # type: ignore[arg-type]


def plan_flips(snapshot: Snapshot) -> list[tuple[str, str]]:
    """The planner's autonomous flips as (cell_id, to)."""
    return [(str(d.cell_id), d.to) for d in planner.plan_flips(snapshot)]

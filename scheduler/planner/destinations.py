"""Where moved and new requests go, as functions of a `Snapshot`.

    choose_destination(snapshot, source, request)    -> Destination     one migration
    choose_destinations(snapshot, moves)             -> [Destination]   a whole drain, one heap pass
    move_seconds(context_tokens, same_node, path)    -> float           a path's cost (paths.py)

Both are pure on a snapshot alone: they build a fresh `Placement` (scheduler/planner/room.py)
over its cells, O(cells). The controller passes the `Placement` it keeps up to date from the
store's changes (`placement=`), so a placement there costs O(log cells) and uses up the room
it takes in that index, which the controller owns; the snapshot is never changed.

A destination is a rollout cell with room, same version first (a KV copy needs the version the
KV was computed with), then fewest in flight, then the source's node; the path is a KV copy when
both ends can and it is cheaper than a re-prefill (scheduler/planner/paths.py).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from scheduler.planner.paths import DEFAULT_COST, move_seconds
from scheduler.planner.room import Placement, placement_for
from scheduler.planner.types import CellId, Destination, LinkCostModel, RequestSummary, Snapshot

__all__ = ["choose_destination", "choose_destinations", "move_seconds"]


def choose_destination(snapshot: Snapshot, source_cell_id: CellId | None, request: RequestSummary,
                       cost: LinkCostModel = DEFAULT_COST, placement: Placement | None = None) -> Destination:
    """Where one request goes: a rollout cell with room, same version first, then fewest in
    flight, then same node; by KV copy when both ends can and it is cheaper than re-prefill.
    `source_cell_id` None places a new or suspended request."""
    return choose_destinations(snapshot, [(source_cell_id, request)], cost, placement=placement)[0]


def choose_destinations(snapshot: Snapshot,
                        moves: Sequence[tuple[CellId | None, RequestSummary]],
                        cost: LinkCostModel = DEFAULT_COST, in_order: bool = False,
                        only: Container[CellId] | None = None,
                        placement: Placement | None = None) -> list[Destination]:
    """Place many requests in one pass; earlier placements use up room for later ones.

    Larger contexts are placed first (they gain most from a same-version KV copy); with
    `in_order`, in the order of `moves` (a queue served oldest first). Source cells are never
    destinations. Results are in the order of `moves`. With `placement` (the controller's kept
    index over `snapshot.cells`) they are placed on it in O(moves log cells), and use up room
    there; without, a fresh one is built (O(cells)) and the call is pure. `only`: the cells
    that may take them (one job's cells on a fleet shared by several; None: any).
    """
    return placement_for(snapshot, placement).place(moves, cost, in_order, only)

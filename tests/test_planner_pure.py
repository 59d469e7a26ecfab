"""The planner is pure on its input: every planner function leaves the `Snapshot` it is given,
and each of its cells, as they were; room is used up only in a `Placement` the caller passes
(the controller's kept one), never in state hidden in the snapshot."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.planner import placement as door  # noqa: E402
from scheduler.planner.destinations import choose_destination, choose_destinations  # noqa: E402
from scheduler.planner.plan import choose_cells_to_flip, plan_flips, wanted_training_cells  # noqa: E402
from scheduler.planner.room import Placement  # noqa: E402
from tests.test_planner import FREE, cell, req, snap  # noqa: E402


def _state(s) -> tuple:
    """Everything a snapshot holds, by value: its fields and each cell's fields."""
    fields = tuple((f.name, getattr(s, f.name)) for f in dataclasses.fields(s) if f.name != "cells")
    return fields, tuple(dataclasses.astuple(c) for c in s.cells)


def _fleet():
    cells = [cell(i, inflight=i % 5, capacity=8, version=i % 2, node=f"n{i % 3}", tokens=1000 * i)
             for i in range(10)]
    cells += [cell(10, role="training", inflight=0, capacity=8), cell(11, role="training", inflight=0, capacity=8)]
    return snap(cells, waiting=4096, min_rollout=2)


def _every_planner_call(s, placement=None) -> list:
    moves = [(0, req("a", tokens=3000, version=0)), (None, req("b", tokens=500, version=1)),
             (2, req("c", tokens=9000, version=0))]
    return [
        plan_flips(s, FREE, placement=placement), wanted_training_cells(s),
        choose_cells_to_flip(s, "training", 3, placement=placement),
        choose_cells_to_flip(s, "rollout", 2, placement=placement),
        choose_destinations(s, moves, placement=placement), choose_destinations(s, moves, in_order=True, placement=placement),
        choose_destination(s, 1, req("d", tokens=100, version=1), placement=placement),
        door.choose_destinations(s, "c0", [req("e", tokens=100)], placement=placement),
        door.sticky_destination(s, 3, req("f", tokens=100), placement=placement),
        door.plan_flips(s, placement=placement),
    ]


def test_planner_calls_leave_the_snapshot_and_its_cells_unchanged():
    s = _fleet()
    before, cells = _state(s), s.cells
    first = _every_planner_call(s)
    assert _state(s) == before and s.cells is cells
    assert all(a is b for a, b in zip(s.cells, cells, strict=True))
    assert _every_planner_call(s) == first  # pure: the same answers again
    kept = Placement(s.cells)
    _every_planner_call(s, kept)
    assert _state(s) == before  # a caller's index takes the placements, the snapshot none


def test_placements_use_up_room_only_in_the_index_passed():
    """The negative control: with the caller's index, a second identical placement sees the
    room the first took (its answer differs); the snapshot-only call does not."""
    s = snap([cell(0, inflight=6, capacity=8), cell(1, inflight=7, capacity=8)])
    moves = [(None, req("x", tokens=100))]
    assert choose_destinations(s, moves) == choose_destinations(s, moves)
    kept = Placement(s.cells)
    one, two, three = (choose_destinations(s, moves, placement=kept)[0].cell_id for _ in range(3))
    assert (one, two, three) == (0, 0, 1)  # cell 0 fills (7, then 8 in flight), then cell 1
    assert choose_destinations(s, moves)[0].cell_id == 0  # the snapshot still says cell 0 has room
    assert kept.inflight[0] == 8


def test_the_unchanged_check_sees_a_change():
    """The negative control of `_state`: a cell changed in place (which no planner function
    may do) and a snapshot with another field both show."""
    s = _fleet()
    before = _state(s)
    c = s.cells[0]
    object.__setattr__(c, "inflight", c.inflight + 1)
    assert _state(s) != before
    assert _state(dataclasses.replace(_fleet(), finished_waiting=0)) != _state(_fleet())

"""The planner's division of the fleet between RL jobs (scheduler/planner/jobs.py): minimums
first, maximums respected, the rest by weight up to demand, a dead band against thrash."""

from __future__ import annotations

from scheduler.planner.jobs import JobShare, divide, ideal_shares, moves


def J(name, lo=0, hi=100, w=1.0, demand=0.0, held=0):  # noqa: N802
    return JobShare(name, lo, hi, w, demand, held)


def test_minimums_first_then_weight_up_to_demand():
    jobs = [J("a", lo=2, w=1, demand=100), J("b", lo=3, w=3, demand=100)]
    assert divide(jobs, 20) == {"a": 6, "b": 14}  # 5 fixed, 15 shared 1:3 → 2+3.75, 3+11.25
    # demand caps a job's share; what it leaves goes to the other
    assert divide([J("a", demand=2), J("b", demand=100)], 10) == {"a": 2, "b": 8}
    # minimums hold even with no demand; a maximum holds even with demand
    assert divide([J("a", lo=4), J("b", hi=3, demand=100)], 10) == {"a": 7, "b": 3}
    # minimums past the fleet: the heavier job's first
    assert divide([J("a", lo=8, w=1), J("b", lo=8, w=2)], 10) == {"a": 2, "b": 8}


def test_spare_cells_past_every_maximum_stay_unassigned():
    out = divide([J("a", hi=2, demand=9), J("b", hi=3, demand=9)], 10)
    assert out == {"a": 2, "b": 3}
    assert sum(ideal_shares([J("a", hi=2), J("b", hi=3)], 10).values()) == 5


def test_hysteresis_keeps_a_holding_near_its_share():
    # ideal 5/5; holding 6/4 is within the dead band of 1 cell: nothing moves
    jobs = [J("a", demand=50, held=6), J("b", demand=50, held=4)]
    assert divide(jobs, 10, hysteresis_cells=2.0) == {"a": 6, "b": 4}
    # negative control: without the band the same holding is evened out
    assert divide(jobs, 10, hysteresis_cells=0.0) == {"a": 5, "b": 5}
    # a move's cost widens the band: 300 s of a 600 s horizon is half a cell more
    jobs = [J("a", demand=50, held=7), J("b", demand=50, held=3)]
    assert divide(jobs, 10, hysteresis_cells=1.0) == {"a": 5, "b": 5}
    assert divide(jobs, 10, hysteresis_cells=1.0, move_cost_s=900.0, horizon_s=600.0) == {"a": 7, "b": 3}


def test_division_is_stable_tick_to_tick():
    jobs = [J("a", demand=3.6, held=3), J("b", demand=1.4, held=2)]
    first = divide(jobs, 5)
    again = divide([J("a", demand=3.6, held=first["a"]), J("b", demand=1.4, held=first["b"])], 5)
    assert first == again == {"a": 4, "b": 1}


def test_moves_pair_surplus_with_deficit():
    assert sorted(moves({"a": 2, "b": 5, "c": 3}, {"a": 5, "b": 3, "c": 2})) == [("a", "b"), ("a", "b"), ("a", "c")]
    assert moves({"a": 3}, {"a": 3}) == []
    assert moves({"a": 4}, {"a": 2, "gone": 2}) == [("gone", "a"), ("gone", "a")]  # a deleted job gives all

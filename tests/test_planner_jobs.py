"""scheduler/planner/jobs.py: the division of a fleet between jobs, by property, each with a
negative control that must fail."""

from __future__ import annotations

import random

import pytest

from scheduler.planner.jobs import (
    FREE,
    JobShare,
    JobShareError,
    cells_to_release,
    demand_cells,
    divide,
    ideal_targets,
    moves,
)
from scheduler.planner.types import CellSummary


def job(name: str, demand: float, held: int, lo: int = 0, hi: int = 10_000, w: float = 1.0) -> JobShare:
    return JobShare(name, lo, hi, w, demand, held)


def random_jobs(rng: random.Random, total: int) -> list[JobShare]:
    n = rng.randint(1, 5)
    mins = [rng.randint(0, total // (2 * n)) for _ in range(n)]
    held_left = total
    out = []
    for i, lo in enumerate(mins):
        held = rng.randint(0, held_left // 2)
        held_left -= held
        out.append(job(f"j{i}", rng.choice([0.0, rng.uniform(0, total), 1e9]), held, lo,
                       lo + rng.randint(0, total), rng.uniform(0.1, 5.0)))
    return out


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def test_mins_max_and_total_hold_on_random_fleets():
    rng = random.Random(7)
    for _ in range(400):
        total = rng.randint(1, 300)
        jobs = random_jobs(rng, total)
        kw = dict(hysteresis_cells=rng.choice([0.0, 1.0, 5.0]), move_cost_s=rng.choice([0.0, 20.0, 700.0]))
        t = divide(jobs, total, **kw)
        assert sum(t.values()) <= total
        for j in jobs:
            assert j.min_cells <= t[j.name] <= j.max_cells, (j, t)


def test_negative_control_a_division_that_skips_mins_is_caught():
    jobs = [job("a", 1e9, 95, lo=0), job("b", 0.0, 5, lo=10)]
    t = divide(jobs, 100)
    assert t["b"] >= 10
    broken = ideal_targets([job("a", 1e9, 95), job("b", 0.0, 5)], 100)  # min dropped
    assert broken["b"] < 10


def test_weights_respected_when_all_saturated():
    jobs = [job("a", 1e9, 0, w=1.0), job("b", 1e9, 0, w=2.0), job("c", 1e9, 0, w=3.0)]
    t = divide(jobs, 600)
    assert t == {"a": 100, "b": 200, "c": 300}
    assert jain([t[j.name] / j.weight for j in jobs]) == pytest.approx(1.0)
    # negative control: the same fleet split evenly is not fair by weight
    assert jain([200 / 1.0, 200 / 2.0, 200 / 3.0]) < 0.9


def test_water_filling_gives_spare_to_unmet_demand():
    t = divide([job("a", 1e9, 0), job("b", 30.0, 0), job("c", 1e9, 0)], 300)
    assert t == {"a": 135, "b": 30, "c": 135}
    assert divide([job("a", 10.2, 0), job("b", 20.0, 0)], 100) == {"a": 11, "b": 20}  # demand met, rest free


def test_max_respected_and_excess_shed():
    t = divide([job("a", 1e9, 80, hi=50), job("b", 1e9, 20)], 100)
    assert t == {"a": 50, "b": 50}


def test_hysteresis_stops_thrash_on_noisy_demand():
    rng = random.Random(3)
    held = {"a": 50, "b": 50}

    def run(band: float) -> int:
        h, moved = dict(held), 0
        for _ in range(200):  # both want about 50 + noise; the fleet is full
            jobs = [job(n, 50 + rng.gauss(0, 1.5), h[n]) for n in ("a", "b")]
            t = divide(jobs, 100, hysteresis_cells=band)
            moved += len(moves(t, h))
            h = t
        return moved

    assert run(3.0) == 0
    assert run(0.0) > 20  # negative control: no band, the noise moves cells back and forth


def test_a_move_not_worth_its_cost_is_not_made():
    jobs = [job("a", 80.0, 50), job("b", 20.0, 50)]
    assert divide(jobs, 100, move_cost_s=400.0, horizon_s=600.0) == {"a": 50, "b": 50}
    assert divide(jobs, 100, move_cost_s=100.0, horizon_s=600.0) == {"a": 80, "b": 20}  # control
    # a fractional last cell: 0.3 of a cell's use over 600 s does not pay a 200 s move
    t = divide([job("a", 60.3, 50), job("b", 10.0, 50)], 100, move_cost_s=200.0, hysteresis_cells=0.0)
    assert t["a"] == 60


def test_a_min_is_restored_whatever_the_cost_or_band():
    t = divide([job("a", 1e9, 100), job("b", 1e9, 0, lo=10)], 100, move_cost_s=1e6, hysteresis_cells=50)
    assert t == {"a": 90, "b": 10}


def test_moves_take_held_to_targets():
    rng = random.Random(11)
    for _ in range(200):
        total = rng.randint(1, 200)
        jobs = random_jobs(rng, total)
        held = {j.name: j.held for j in jobs}
        t = divide(jobs, total, hysteresis_cells=0.0)
        after = dict(held)
        for src, dst in moves(t, held):
            assert src != dst
            if src != FREE:
                after[src] -= 1
            if dst != FREE:
                after[dst] += 1
        assert after == t
    # negative control: a pair list missing one move does not reach the targets
    pairs = moves({"a": 3, "b": 1}, {"a": 1, "b": 3})
    assert pairs == [("b", "a"), ("b", "a")]
    short = {"a": 1, "b": 3}
    for src, dst in pairs[:-1]:
        short[src] -= 1
        short[dst] += 1
    assert short != {"a": 3, "b": 1}


def test_bad_input_is_refused_clearly():
    with pytest.raises(JobShareError, match="min_cells sum"):
        divide([job("a", 1, 0, lo=60), job("b", 1, 0, lo=60)], 100)
    with pytest.raises(JobShareError, match="unique"):
        divide([job("a", 1, 0), job("a", 1, 0)], 10)
    with pytest.raises(JobShareError, match="weight"):
        divide([job("a", 1, 0, w=0.0)], 10)
    with pytest.raises(JobShareError, match="hold"):
        divide([job("a", 1, 8), job("b", 1, 8)], 10)
    with pytest.raises(JobShareError, match="min_cells <= max_cells"):
        divide([job("a", 1, 0, lo=5, hi=4)], 10)
    with pytest.raises(JobShareError):
        demand_cells(1.0, 10.0, 0, 1.0)


def test_cells_to_release_prefers_idle_then_training_then_fewest_rollouts():
    def cell(i: int, role: str, inflight: int, busy: bool = False, tokens: int = 0) -> CellSummary:
        return CellSummary(i, "n", role, 0, inflight, 16, 0, 16, 0, True, busy, tokens)

    cells = [cell(0, "rollout", 5), cell(1, "training", 0, busy=True), cell(2, "rollout", 0),
             cell(3, "training", 0), cell(4, "rollout", 2, tokens=900), cell(5, "rollout", 2, tokens=100)]
    assert cells_to_release(cells, 6) == [2, 3, 1, 5, 4, 0]
    assert cells_to_release(cells, 2) == [2, 3]
    with pytest.raises(JobShareError):
        cells_to_release(cells, 7)


def test_demand_cells_counts_rollout_slots_and_training():
    # 1 session/s of 1,600 slot-seconds on 16-slot cells = 100 cells, plus 20 training cells
    assert demand_cells(1.0, 1600.0, 16, 20.0) == pytest.approx(120.0)


def test_demand_from_live_sessions_leads_a_rise_and_keeps_a_fall():
    # steady state: 1,600 live sessions finishing at 1/s = the arrivals: 100 + 20 cells either way
    assert demand_cells(1.0, 1600.0, 16, 20.0, live_sessions=1600.0, lead_s=600.0) == pytest.approx(120.0)
    rising = demand_cells(2.0, 1600.0, 16, 20.0, live_sessions=1600.0, lead_s=600.0)
    assert rising == pytest.approx((1600 + 600) / 16 + 20.0)
    falling = demand_cells(0.1, 1600.0, 16, 20.0, live_sessions=1600.0, lead_s=600.0)
    assert falling == pytest.approx(120.0)  # the live sessions still hold their slots
    assert demand_cells(0.1, 1600.0, 16, 20.0) < 20  # control: the steady state alone would give them away

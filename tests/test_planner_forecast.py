"""The planner sized on the sessions starting now: the measured rate of new sessions, its
forecast along the trend, parking while demand moves; and how `Rates` measures them."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.control.rates import Rates  # noqa: E402
from scheduler.planner.plan import (  # noqa: E402
    demand_moving,
    may_park,
    plan_flips,
    production_rate_per_slot_s,
    wanted_training_cells,
)
from scheduler.planner.types import CellSummary, PlannerPolicy, Snapshot  # noqa: E402

B = 1024
SLOT_RATE = 1 / 7200.0  # one session per slot per 2 h
TRAIN_RATE = B / (32 * 3600.0)
ON = PlannerPolicy(follow_new_sessions=True, park_moving=True)
"""Following the sessions starting now, parking while demand moves (both off by default)."""


def cell(i, role="rollout", inflight=16):
    return CellSummary(i, f"n{i}", role, 0, inflight, 16, (16 - inflight) * 100, 1600, 0, True, False, 0)


def snap(cells, waiting=B, new=0.0, trend=0.0, queued=0):
    return Snapshot(cells=tuple(cells), finished_waiting=waiting, batch_size=B, training_in_progress=True,
                    min_rollout_cells=1, queued_sessions=queued, steps_in_progress=1,
                    finish_rate_per_slot_s=SLOT_RATE, train_rate_per_cell_s=TRAIN_RATE,
                    new_session_rate_per_slot_s=new, new_session_rate_trend=trend)


def test_production_rate_is_the_new_sessions_forecast_ahead():
    pol = ON
    cells = [cell(i) for i in range(10)]
    assert production_rate_per_slot_s(snap(cells, new=2 * SLOT_RATE), PlannerPolicy()) == SLOT_RATE  # default
    assert production_rate_per_slot_s(snap(cells), pol) == SLOT_RATE  # nothing new measured: finishes
    flat = snap(cells, new=2 * SLOT_RATE)
    assert production_rate_per_slot_s(flat, pol) == pytest.approx(2 * SLOT_RATE)
    # rising 1e-8 a second, forecast 0.125 mean slot times (900 s) ahead
    rising = snap(cells, new=2 * SLOT_RATE, trend=1e-8)
    assert production_rate_per_slot_s(rising, pol) == pytest.approx(2 * SLOT_RATE + 900 * 1e-8)
    falling = snap(cells, new=2 * SLOT_RATE, trend=-1.0)
    assert production_rate_per_slot_s(falling, pol) == pytest.approx(0.2 * 2 * SLOT_RATE)  # the floor
    # negative control: without the lead the trend is ignored
    assert production_rate_per_slot_s(rising, replace(pol, forecast_lead_sessions=0.0)) != pytest.approx(
        production_rate_per_slot_s(rising, pol))


def test_short_sessions_starting_now_give_training_more_cells():
    # sessions starting now hold a slot half as long: the rollout side will produce twice as
    # much, p = 2 * 16 / 7200, q = 1024 / 115200: T = N p / (p + q) = 100 / 3
    cells = [cell(i) for i in range(100)]
    assert wanted_training_cells(snap(cells), ON) == pytest.approx(20.0)
    assert wanted_training_cells(snap(cells, new=2 * SLOT_RATE), ON) == pytest.approx(100 / 3)
    assert wanted_training_cells(snap(cells, new=SLOT_RATE), ON) == pytest.approx(20.0)  # steady: the same
    assert wanted_training_cells(snap(cells, new=2 * SLOT_RATE)) == pytest.approx(20.0)  # default: finishes


def test_parks_beyond_the_room_only_while_demand_moves():
    pol = replace(ON, max_flip_fraction_per_tick=1.0)
    full = [cell(i) for i in range(100)]  # no free slot anywhere
    steady, moving = snap(full, waiting=40 * B, new=SLOT_RATE), snap(full, waiting=40 * B, new=2 * SLOT_RATE)
    assert not demand_moving(steady, pol) and demand_moving(moving, pol)
    assert not may_park(steady, pol) and may_park(moving, pol)
    assert len(plan_flips(steady, pol)) == 1  # into the room: one cell a tick at most
    assert len(plan_flips(moving, pol)) > 1  # parked: as many as the balance wants
    # negative controls: parking off, or too many sessions parked already
    assert len(plan_flips(moving, replace(pol, park_moving=False))) == 1
    assert len(plan_flips(moving, replace(pol, follow_new_sessions=False))) == 1
    crowded = replace(moving, queued_sessions=8 * B)
    assert not may_park(crowded, pol) and len(plan_flips(crowded, pol)) == 1


def test_rates_measure_new_sessions_and_their_trend():
    r = Rates()
    r.on_new_sessions(0.0, 100.0, 10)  # no finished session yet: tokens a session unknown
    assert r.new_session_rate_per_slot_s == 0.0
    r.on_finish(4, 4 * 20_000.0)
    r.on_tick(60.0, 64, 64)
    assert r.tokens_per_session() == pytest.approx(20_000.0)
    # 16 new sessions at 20,000 tokens in 1 h each: 1 / 3600 s
    r.on_new_sessions(60.0, 16 * 20_000 / 3600.0, 16)
    assert r.new_session_rate_per_slot_s == pytest.approx(1 / 3600.0) and r.new_session_rate_trend == 0.0
    r.on_new_sessions(120.0, 16 * 20_000 / 1800.0, 16)  # twice as fast a minute later: rising
    assert r.new_session_rate_per_slot_s == pytest.approx(1 / 1800.0) and r.new_session_rate_trend > 0.0
    before = r.new_session_rate_trend
    r.on_new_sessions(180.0, 0.0, 0)  # nothing started: the last measure stands
    assert r.new_session_rate_per_slot_s == pytest.approx(1 / 1800.0) and r.new_session_rate_trend == before
    r.on_new_sessions(240.0, 16 * 20_000 / 3600.0, 16)  # slower again: the trend turns down
    assert r.new_session_rate_trend < before


# ------------------------------------------------------------------ a fast wave turns both on

def test_swings_measure_a_wave_and_ignore_noise():
    """`Rates.on_new_sessions` feeds `Swings`: a sine of the new sessions' rate (2 h period,
    extremes 3x apart) gives its period and swing; +-5 % noise gives no wave; a wave that stops
    is forgotten after a period."""
    import math

    from scheduler.control.rates import Swings

    wave, noise = Swings(), Swings()
    for k in range(0, 12 * 60):  # a minute apart, 12 h
        t = 60.0 * k
        wave.on_rate(t, 1.0 / (7200.0 * (1.0 + 0.5 * math.sin(2 * math.pi * t / 7200.0))))
        noise.on_rate(t, SLOT_RATE * (1.05 if k % 2 else 0.95))
    assert wave.period_s() == pytest.approx(7200.0, abs=120.0) and wave.swing() == pytest.approx(3.0, rel=0.05)
    assert noise.period_s() == 0.0 and noise.swing() == 0.0
    for k in range(12 * 60, 12 * 60 + 150):  # flat for 2.5 h: the wave stopped
        wave.on_rate(60.0 * k, SLOT_RATE)
    assert wave.period_s() == 0.0


def test_a_fast_wide_wave_follows_and_parks_unasked():
    """A wave of the new sessions' rate within one slot time and 3x apart turns on what
    `follow_new_sessions` and `park_moving` ask for; a slower wave, a narrower one, or the gate
    set to 0 leaves the default planner on the finish rate (controls)."""
    from scheduler.planner.plan import fast_wave

    cells = [cell(i) for i in range(10)]
    base = snap(cells, new=2 * SLOT_RATE)
    fast = replace(base, new_session_rate_period_s=0.9 * 7200.0, new_session_rate_swing=2.9)
    default = PlannerPolicy()
    assert fast_wave(fast, default) and production_rate_per_slot_s(fast, default) == pytest.approx(2 * SLOT_RATE)
    assert may_park(fast, default)
    for other in (replace(fast, new_session_rate_period_s=1.4 * 7200.0), replace(fast, new_session_rate_swing=2.0),
                  base):
        assert not fast_wave(other, default)
        assert production_rate_per_slot_s(other, default) == SLOT_RATE and not may_park(other, default)
    off = replace(default, fast_wave_sessions=0.0)
    assert not fast_wave(fast, off) and production_rate_per_slot_s(fast, off) == SLOT_RATE

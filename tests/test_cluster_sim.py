"""The cluster simulator: hand-computed scenarios, the trainer model, and the planner in the loop."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from sim import BUILTIN, Workload, WorkloadError, load_workload, make_policy, run_policy  # noqa: E402
from sim.cluster import LOADING, ROLLOUT, TRAINING, Cluster  # noqa: E402
from sim.trainer import Trainer  # noqa: E402

from scheduler.planner import plan_flips  # noqa: E402

HOUR = 3600.0


def tiny(**kw) -> Workload:
    """Fixed one-hour sessions of 1,000 tokens, one per cell, one-session batches of 1 cell-hour."""
    base = dict(name="tiny", session_mean_hours=1.0, session_sigma=0.0, session_tokens=1000,
                cell_capacity=1, batch_size=1, step_cell_hours=1.0, max_cells_per_step=1,
                broadcast_s=0.0, staleness_bound=40)
    return Workload(**(base | kw))


# ------------------------------------------------------------------ hand-computed runs

def test_static_two_cells_by_hand():
    # one rollout cell finishes a session every hour; the training cell trains each for an hour.
    # By 10.5 h: sessions end at 1..10 h, steps end at 2..10 h, the 10th step is half done.
    r = run_policy(tiny(), make_policy("static", 0.5), n_cells=2, hours=10.5, check=True)
    assert r.trained_sessions == pytest.approx(9.5)
    assert r.trained_tokens_per_hour == pytest.approx(9.5 * 1000 / 10.5)
    assert r.utilization == pytest.approx((10.5 + 9.5) / 21.0)
    # session 1 starts at version 0 and trains at 0; every later one starts one step behind
    assert r.staleness_hist == [1, 8]
    assert r.mean_staleness == pytest.approx(8 / 9)
    assert r.dropped_sessions == 0 and r.recomputed_tokens == 0


@pytest.mark.parametrize("width, sessions, util", [(1, 6, 0.75), (2, 8, 1.0)])
def test_sync_two_cells_by_hand(width, sessions, util):
    # both cells decode 1 h, then train one 2-session step of 1 cell-hour on `width` cells
    # (1 h or 0.5 h), then start the next load: cycles of 2 h or 1.5 h within 6 h
    wl = tiny(batch_size=2, max_cells_per_step=width)
    r = run_policy(wl, make_policy("sync"), n_cells=2, hours=6.0, check=True)
    assert r.trained_sessions == pytest.approx(sessions)
    assert r.utilization == pytest.approx(util)
    assert r.mean_staleness == 0.0


def test_staleness_bound_drops_and_counts():
    # bound 0, two rollout cells feeding one training cell (one session per step, 1 h each).
    # At 1 h, 3 h, 5 h a step starts on a fresh session; when it ends (2 h, 4 h, 6 h) the
    # version moves on and the three sessions waiting (first token one version back) are
    # dropped: 3 trained, 9 dropped, every trained one at staleness 0.
    r = run_policy(tiny(staleness_bound=0), make_policy("static", 0.67), n_cells=3, hours=6.0,
                   check=True)
    assert r.trained_sessions == pytest.approx(3.0)
    assert r.dropped_sessions == 9
    assert r.staleness_hist == [3]
    assert r.lost_work_cell_hours == pytest.approx(9.0)  # nine one-hour sessions thrown away


# ------------------------------------------------------------------ moves

def _half_done_cluster(can_export_kv: bool) -> Cluster:
    """Cell 0 holds two sessions at 50 % (10,000 tokens each); cell 1 has just entered rollout."""
    wl = Workload(name="t", session_mean_hours=1.0, session_sigma=0.0, session_tokens=20_000,
                  cell_capacity=2, batch_size=100, broadcast_s=0.0)
    cl = Cluster(wl, 2, 2.0, 0, 60.0, can_export_kv, Trainer(100, 1.0, 128, 40, False))
    cl.set_roles([1], TRAINING, 0.0)
    cl.sync_trainer_cells(0.0)
    cl.admit(0.0)
    cl.advance(1800.0)
    cl.set_roles([1], LOADING, 1800.0)
    cl.advance(1800.0)
    assert cl.role[1] == ROLLOUT
    cl.set_roles([0], TRAINING, 1800.0)
    cl.drain([0], 1800.0)
    cl.sync_trainer_cells(1800.0)
    cl.check_integrity()
    return cl


def test_drain_moves_kv_by_hand():
    cl = _half_done_cluster(can_export_kv=True)
    copy_s = 10_000 * 96 * 1024 / 450e9  # same node: NVLink
    assert cl.moved == {"kv": 2, "reprefill": 0, "suspend": 0}
    assert cl.recomputed_tokens == 0
    assert sorted(cl.end[2:4]) == pytest.approx([HOUR + copy_s] * 2)
    cl.advance(HOUR + 1.0)
    assert cl.trainer.queue.size == 2 and cl.inflight.tolist() == [0, 0]


def test_drain_reprefills_without_kv_export():
    cl = _half_done_cluster(can_export_kv=False)
    assert cl.moved == {"kv": 0, "reprefill": 2, "suspend": 0}
    assert cl.recomputed_tokens == 20_000
    assert sorted(cl.end[2:4]) == pytest.approx([HOUR + 0.5] * 2)  # 10,000 tokens at 20,000/s


# ------------------------------------------------------------------ trainer

def test_trainer_concurrent_and_sequential_steps():
    tr = Trainer(batch_size=1, step_cell_hours=1.0, max_cells_per_step=2, staleness_bound=None,
                 sequential=False)
    tr.set_cells(4, 0.0)
    tr.feed(np.zeros(3), np.zeros(3, dtype=np.int64), np.ones(3))
    assert len(tr.steps) == 2  # 4 cells, 2 per step
    tr.run_until(HOUR)
    assert (tr.version, tr.step_end_times) == (3, [1800.0, 1800.0, 3600.0])
    assert tr.busy_cell_s == pytest.approx(3 * HOUR)  # three steps of one cell-hour
    seq = Trainer(1, 1.0, 2, None, sequential=True)
    seq.set_cells(4, 0.0)
    seq.feed(np.zeros(3), np.zeros(3, dtype=np.int64), np.ones(3))
    seq.run_until(2 * HOUR)
    assert seq.step_end_times == [1800.0, 3600.0, 5400.0]


def test_trainer_step_starts_when_batch_completes():
    tr = Trainer(batch_size=2, step_cell_hours=1.0, max_cells_per_step=1, staleness_bound=1,
                 sequential=False)
    tr.set_cells(1, 0.0)
    tr.version = 5
    accepted = tr.feed(np.array([10.0, 20.0, 30.0]), np.array([3, 4, 5]), np.ones(3))
    assert (accepted, tr.dropped) == (2, 1)  # 5 - 3 > 1
    tr.run_until(30.0)
    assert len(tr.steps) == 1 and tr.steps[0][0] == pytest.approx(HOUR - 0.0)
    tr.run_until(30.0 + HOUR)
    assert tr.step_end_times == [pytest.approx(30.0 + HOUR)]


# ------------------------------------------------------------------ the planner in the loop

def test_simulator_decisions_are_the_planners():
    wl = load_workload("stationary")
    policy = make_policy("cellflip", record=True)
    r = run_policy(wl, policy, n_cells=48, hours=12.0, check=True)
    assert policy.log and r.flips == sum(len(d) for _, d in policy.log) > 0
    for snap, decided in policy.log:
        assert plan_flips(snap) == decided
        for d in decided:  # every flip was legal in the snapshot it came from
            role = next(c.role for c in snap.cells if c.cell_id == d.cell_id)
            assert role == ("rollout" if d.to == "training" else "training")


def test_cellflip_migrates_where_flip_abort_recomputes():
    wl = load_workload("drifting")
    cf = run_policy(wl, make_policy("cellflip"), n_cells=48, hours=12.0, check=True)
    fa = run_policy(wl, make_policy("flip_abort"), n_cells=48, hours=12.0, check=True)
    assert cf.moves["kv"] > 0 and cf.moves["reprefill"] == cf.moves["suspend"]
    assert fa.moves["kv"] == 0 and fa.recomputed_tokens > cf.recomputed_tokens
    sync = run_policy(wl, make_policy("sync"), n_cells=48, hours=12.0)
    assert cf.utilization > 0.9 > 0.5 > sync.utilization
    assert cf.trained_tokens_per_hour > 2 * sync.trained_tokens_per_hour


# ------------------------------------------------------------------ workloads

def test_builtin_workloads_load():
    st, dr = (load_workload(n) for n in BUILTIN)
    assert st.mean_hours_at(0.0, 72 * HOUR) == pytest.approx(2.0)
    assert dr.mean_hours_at(36 * HOUR, 72 * HOUR) == pytest.approx(2.0)
    assert dr.mean_hours_at(72 * HOUR, 72 * HOUR) == pytest.approx(3.0)
    d = st.draw_durations_s(np.random.default_rng(0), np.zeros(200_000), 72 * HOUR) / HOUR
    assert d.mean() == pytest.approx(2.0, rel=0.01)
    assert np.quantile(d, 0.99) == pytest.approx(2.0 * math.exp(-0.08 + 2.3263 * 0.4), rel=0.02)


def test_bad_workload_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsession_mean_hours: 2\ncell_capcity: 16\n")
    with pytest.raises(WorkloadError, match="cell_capcity"):
        load_workload(str(bad))
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(str(tmp_path / "missing.yaml"))

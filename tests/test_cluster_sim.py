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

from scheduler.planner.plan import plan_flips  # noqa: E402

HOUR = 3600.0


def tiny(**kw) -> Workload:
    """Fixed one-hour sessions of 1,000 tokens, one per cell, one-session batches of 1 cell-hour."""
    base = dict(name="tiny", session_mean_hours=1.0, session_sigma=0.0, session_tokens=1000,
                cell_capacity=1, batch_size=1, step_cell_hours=1.0, max_cells_per_step=1,
                broadcast_s=0.0, staleness_bound=40, batch_ref_cells=None, scaling_efficiency=1.0)
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


def test_a_version_slows_the_decoding_sessions():
    # 75 min sessions feeding one-hour steps: versions land while a session decodes. Each
    # version streaming in over 600 s at 0.9x decode puts it 60 s behind; at ratio 1 (the
    # control) the run is the one without the charge
    runs = {ratio: run_policy(tiny(session_mean_hours=1.25, broadcast_s=600.0, broadcast_decode_ratio=ratio),
                              make_policy("static", 0.5), n_cells=2, hours=10.5, check=True)
            for ratio in (0.9, 1.0)}
    plain = run_policy(tiny(session_mean_hours=1.25), make_policy("static", 0.5), n_cells=2, hours=10.5)
    assert runs[1.0].trained_sessions == plain.trained_sessions
    assert runs[0.9].trained_sessions < plain.trained_sessions
    assert runs[0.9].lost_work_cell_hours == pytest.approx(60.0 * (runs[0.9].versions - 1) / HOUR, rel=0.5)


def test_sync_two_cells_by_hand():
    # verl-like rounds: both cells decode 1 h, then the whole fleet (2 cells, even where a
    # step's width is 1) trains one 2-session update of 1 cell-hour (0.5 h), then the next
    # round: 4 rounds in 6 h
    wl = tiny(batch_size=2, max_cells_per_step=1)
    r = run_policy(wl, make_policy("sync"), n_cells=2, hours=6.0, check=True)
    assert r.trained_sessions == pytest.approx(8)
    assert r.utilization == pytest.approx(1.0)
    assert r.mean_staleness == 0.0 and r.versions == 4


def test_sync_p99_cuts_the_round_and_counts_the_cut_tokens():
    # 400 log-normal sessions a round: about 4 run past the p99 and are cut there
    wl = tiny(session_sigma=1.0, cell_capacity=8, sync_timeout_mean_x=100.0)  # no users' timeout
    full = run_policy(wl, make_policy("sync"), n_cells=50, hours=24.0, check=True)
    cut = run_policy(wl, make_policy("sync_p99"), n_cells=50, hours=24.0, check=True)
    assert full.dropped_fraction == 0.0 < cut.dropped_fraction < 0.2
    assert cut.versions >= full.versions
    # the users' timeout (4 mean slot times by default) cuts the rare longest sessions
    users = run_policy(tiny(session_sigma=1.0, cell_capacity=8), make_policy("sync"), n_cells=50, hours=24.0)
    assert 0.0 < users.dropped_fraction < 0.2 and users.versions > full.versions


def test_sync_same_batch_rounds_hold_the_asynchronous_batch():
    wl = tiny(batch_size=3, cell_capacity=2)
    r = run_policy(wl, make_policy("sync_same_batch"), n_cells=4, hours=6.0, check=True)
    # 3 sessions a round (not the fleet's 8 slots): 1 h of decoding, then the 1 cell-hour update
    # on the whole fleet of 4 cells (15 min): a round every 1.25 h, 4 in 6 h, 3 sessions each
    assert r.trained_sessions == pytest.approx(12) and r.versions == 4
    full = run_policy(wl, make_policy("sync"), n_cells=4, hours=6.0, check=True)
    assert full.trained_sessions / full.versions == pytest.approx(8)  # a round fills every slot


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

def _half_done_cluster(mode: str) -> Cluster:
    """Cell 0 holds two sessions at 50 % (10,000 tokens each); cell 1 has just entered rollout."""
    wl = Workload(name="t", session_mean_hours=1.0, session_sigma=0.0, session_tokens=20_000,
                  cell_capacity=2, batch_size=100, broadcast_s=0.0)
    cl = Cluster(wl, 2, 2.0, 0, 60.0, mode, Trainer(100, 1.0, 128, 40))
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
    cl = _half_done_cluster("kv")
    copy_s = 10_000 * 96 * 1024 / 450e9  # same node: NVLink
    assert cl.moved["kv"] == 2 and cl.moved["reprefill"] == cl.moved["suspend"] == 0
    assert cl.recomputed_tokens == 0
    # both ends pay: the first session waits for the second one's copy into its cell too
    assert sorted(cl.end[2:4]) == pytest.approx([HOUR + copy_s, HOUR + 2 * copy_s])
    assert cl.source_delay_cell_s == pytest.approx(2 * copy_s)
    cl.advance(HOUR + 1.0)
    assert cl.trainer.queue.size == 2 and cl.inflight.tolist() == [0, 0]
    assert cl.discarded_tokens == 0


def test_drain_reprefills_without_kv_export():
    cl = _half_done_cluster("reprefill")
    assert cl.moved["kv"] == 0 and cl.moved["reprefill"] == 2
    assert cl.recomputed_tokens == 20_000
    # 10,000 tokens at 20,000/s, paid by the destination: the first waits for both
    assert sorted(cl.end[2:4]) == pytest.approx([HOUR + 0.5, HOUR + 1.0])


def test_drain_abort_restarts_from_the_prompt():
    cl = _half_done_cluster("abort")
    # a whole session again, after the destination prefills each prompt (2,000 tokens at
    # 20,000/s: 0.1 s; the first restarted session waits for the second's prefill too)
    assert cl.moved["abort"] == 2 and cl.recomputed_tokens == 2 * 2000
    assert sorted(cl.end[2:4]) == pytest.approx([1800.0 + HOUR + 0.1, 1800.0 + HOUR + 0.2])
    assert cl.discarded_tokens == 20_000  # two half-done sessions' tokens thrown away


# ------------------------------------------------------------------ trainer

def test_trainer_one_update_at_a_time_on_its_cells():
    # 1,000-token sessions at 3.6 cell-s a token: one cell-hour a session; 4 cells, width 2
    tr = Trainer(batch_size=1, cell_s_per_token=3.6, width=2, staleness_bound=None)
    tr.set_cells(4, 0.0)
    tr.feed(np.zeros(3), np.zeros(3, dtype=np.int64), np.ones(3), np.full(3, 1000.0))
    assert len(tr.steps) == 1 and tr.busy_cells() == 2  # one version at a time, at most 2 wide
    tr.run_until(2 * HOUR)
    assert tr.step_end_times == [1800.0, 3600.0, 5400.0] and tr.version == 3
    assert tr.busy_cell_s == pytest.approx(3 * HOUR)
    assert tr.trained_tokens == 3000 and tr.last_step == (1800.0, 1, 1000.0, 2.0)


def test_trainer_strong_scaling_efficiency():
    tr = Trainer(batch_size=1, cell_s_per_token=3.6, width=4, staleness_bound=None, efficiency=0.81)
    assert tr.eff(1) == 1.0 and tr.eff(2) == pytest.approx(0.9) and tr.eff(4) == pytest.approx(0.81)
    tr.set_cells(4, 0.0)
    tr.feed(np.zeros(1), np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1000.0))
    tr.run_until(2 * HOUR)
    assert tr.step_end_times == [pytest.approx(HOUR / (4 * 0.81))]


def test_a_cell_joining_a_running_step_pays_its_join():
    # one session of one cell-hour; a second cell joins at 0.5 h and trains 10 s later
    tr = Trainer(batch_size=1, cell_s_per_token=3.6, width=2, staleness_bound=None)
    tr.join_s = 10.0
    tr.set_cells(1, 0.0)
    tr.feed(np.zeros(1), np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1000.0))
    tr.set_cells(2, 1800.0)
    tr.run_until(2 * HOUR)
    assert tr.step_end_times == [pytest.approx(1800.0 + (1800.0 + 10.0) / 2)]
    free = Trainer(batch_size=1, cell_s_per_token=3.6, width=2, staleness_bound=None)  # control
    free.set_cells(1, 0.0)
    free.feed(np.zeros(1), np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1000.0))
    free.set_cells(2, 1800.0)
    free.run_until(2 * HOUR)
    assert free.step_end_times == [pytest.approx(2700.0)]


def test_kv_sent_while_no_step_runs_delays_the_next_step():
    # two cells send KV for 30 s each from t = 0; the batch completes at 10 s: the step (one
    # cell-hour on two cells) starts with 2 x 20 cell-seconds still owed
    tr = Trainer(batch_size=1, cell_s_per_token=3.6, width=2, staleness_bound=None)
    tr.set_cells(2, 0.0)
    tr.send_kv(30.0, 2)
    tr.feed(np.array([10.0]), np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1000.0))
    tr.run_until(2 * HOUR)
    assert tr.step_end_times == [pytest.approx(10.0 + (HOUR + 40.0) / 2)]
    late = Trainer(batch_size=1, cell_s_per_token=3.6, width=2, staleness_bound=None)  # sent by then
    late.set_cells(2, 0.0)
    late.send_kv(30.0, 2)
    late.feed(np.array([40.0]), np.zeros(1, dtype=np.int64), np.ones(1), np.full(1, 1000.0))
    late.run_until(2 * HOUR)
    assert late.step_end_times == [pytest.approx(40.0 + HOUR / 2)]


def test_trainer_step_starts_when_batch_completes():
    tr = Trainer(batch_size=2, cell_s_per_token=3.6, width=1, staleness_bound=1)
    tr.set_cells(1, 0.0)
    tr.version = 5
    accepted = tr.feed(np.array([10.0, 20.0, 30.0]), np.array([3, 4, 5]), np.ones(3), np.full(3, 500.0))
    assert (accepted, tr.dropped, tr.dropped_tokens) == (2, 1, 500.0)  # 5 - 3 > 1
    tr.run_until(30.0)
    assert len(tr.steps) == 1 and tr.steps[0].work == pytest.approx(HOUR - 0.0)
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


def test_cellflip_migrates_where_flip_abort_restarts():
    wl = load_workload("drifting")
    cf = run_policy(wl, make_policy("cellflip"), n_cells=48, hours=12.0, check=True)
    fa = run_policy(wl, make_policy("flip_abort"), n_cells=48, hours=12.0, check=True)
    fr = run_policy(wl, make_policy("flip_reprefill"), n_cells=48, hours=12.0, check=True)
    # cellflip re-prefills only sessions it had to suspend (resumed; some wait at the end)
    assert cf.moves["kv"] > 0 and cf.moves["reprefill"] <= cf.moves["suspend"]
    assert fa.moves["kv"] == 0 and fa.moves["abort"] > 0 and fr.recomputed_tokens > cf.recomputed_tokens
    assert fa.dropped_fraction > cf.dropped_fraction
    sync = run_policy(wl, make_policy("sync"), n_cells=48, hours=12.0)
    assert cf.utilization > 0.9 > 0.5 > sync.utilization
    assert cf.trained_tokens_per_hour > 2 * sync.trained_tokens_per_hour


def test_a_paired_twin_has_the_same_sessions_and_roles_and_moves_the_other_way():
    """`run_paired`: the twin replays the lead's flips tick by tick on the same seed. Replayed
    in the lead's own mode it is the lead's run to the last digit (same sessions: common random
    numbers; same roles); in the other mode only the moves differ. Controls: another seed, or
    one recorded flip left out, is another run."""
    from sim.policies import Planned, Replayed
    from sim.run import run_paired

    wl = load_workload("drifting")
    own, twin = run_paired(wl, "cellflip", 48, 12.0, seed=1)
    assert own.flips == twin.flips > 0 and twin.policy == "cellflip@reprefill"
    assert own.series["rollout_cells"] == twin.series["rollout_cells"]
    assert own.series["training_cells"] == twin.series["training_cells"]
    assert own.moves["kv"] > 0 and twin.moves["kv"] == 0 and twin.recomputed_tokens > own.recomputed_tokens
    lead = Planned("cellflip", "kv")
    first = run_policy(wl, lead, 48, 12.0, seed=1)
    same = run_policy(wl, Replayed("again", "kv", lead.trace), 48, 12.0, seed=1, check=True)
    assert same.metrics() == first.metrics() == own.metrics()
    other_seed = run_policy(wl, Replayed("again", "kv", lead.trace), 48, 12.0, seed=2)
    assert other_seed.metrics() != first.metrics()
    t0 = min(lead.trace)
    fewer = dict(lead.trace) | {t0: lead.trace[t0][1:]}
    assert run_policy(wl, Replayed("fewer", "kv", fewer), 48, 12.0, seed=1).metrics() != first.metrics()
    wave = load_workload("sinusoidal")  # a fast wave: the lead parks and starts new sessions ahead
    lead = Planned("cellflip", "kv")
    first = run_policy(wave, lead, 48, 12.0, seed=1)
    assert lead.fresh
    same = run_policy(wave, Replayed("again", "kv", lead.trace, lead.fresh), 48, 12.0, seed=1, check=True)
    assert same.metrics() == first.metrics()
    back, fwd = run_paired(wl, "flip_reprefill", 48, 12.0, seed=1)
    assert back.flips == fwd.flips > 0 and fwd.policy == "flip_reprefill@kv" and fwd.moves["kv"] > 0
    with pytest.raises(ValueError, match="paired run"):
        run_paired(wl, "static", 48, 12.0)


def test_a_replayed_flip_that_no_longer_fits_is_skipped_and_counted():
    from sim.policies import Replayed

    from scheduler.planner.types import FlipDecision

    wl = load_workload("stationary")
    tick = wl.tick_s
    bad = {tick: [FlipDecision(0, "rollout", "test")]}  # cell 0 is a rollout cell: nothing to flip back
    policy = Replayed("bad", "reprefill", bad)
    run_policy(wl, policy, 4, 0.1, seed=1, check=True)
    assert policy.skipped == 1 and policy.flips == 0


def test_oracle_is_a_ceiling_on_a_small_fleet():
    wl = load_workload("stationary")
    runs = {p: run_policy(wl, make_policy(p, 0.8), n_cells=48, hours=12.0, check=True)
            for p in ("static", "cellflip", "oracle")}
    best = max(r.trained_tokens_per_hour for p, r in runs.items() if p != "oracle")
    assert runs["oracle"].trained_tokens_per_hour >= 0.99 * best


# ------------------------------------------------------------------ workloads

def test_builtin_workloads_load():
    st, dr = (load_workload(n) for n in ("stationary", "drifting"))
    assert st.mean_hours_at(0.0, 72 * HOUR) == pytest.approx(2.0)
    assert dr.mean_hours_at(36 * HOUR, 72 * HOUR) == pytest.approx(2.0)
    assert dr.mean_hours_at(72 * HOUR, 72 * HOUR) == pytest.approx(3.0)
    d = st.draw_durations_s(np.random.default_rng(0), np.zeros(200_000), 72 * HOUR) / HOUR
    assert d.mean() == pytest.approx(2.0, rel=0.01)
    assert np.quantile(d, 0.99) == pytest.approx(2.0 * math.exp(-0.08 + 2.3263 * 0.4), rel=0.02)
    for name in BUILTIN:
        load_workload(name)


def test_workload_shapes():
    hv = load_workload("heavy_tail")
    d = hv.draw_durations_s(np.random.default_rng(0), np.zeros(400_000), 72 * HOUR) / HOUR
    assert d.max() <= 24.0 and np.quantile(d, 0.99) == pytest.approx(20.0, rel=0.05)
    sc = load_workload("step_change")
    assert sc.mean_hours_at(11.5 * HOUR, 72 * HOUR) == pytest.approx(6.0)
    assert sc.mean_hours_at(10.5 * HOUR, 72 * HOUR) == pytest.approx(2.0)
    sn = load_workload("sinusoidal")
    assert sn.mean_hours_at(0.5 * HOUR, 72 * HOUR) == pytest.approx(3.0)
    lc = load_workload("long_context")
    assert lc.prefill_s(64_000) == pytest.approx(64_000 / 48_200 + 3.3e-10 * 64_000**2)
    # tokens scale with a session's own slot time
    tok = st_tokens = load_workload("stationary").tokens_of(np.array([3600.0, 14400.0]), np.zeros(2), HOUR)
    assert st_tokens.tolist() == pytest.approx([10_000, 40_000]) and tok is st_tokens


def test_bad_workload_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsession_mean_hours: 2\ncell_capcity: 16\n")
    with pytest.raises(WorkloadError, match="cell_capcity"):
        load_workload(str(bad))
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(str(tmp_path / "missing.yaml"))


@pytest.mark.slow
def test_worker_processes_match_in_process_runs():
    """`--jobs N`: tasks and results cross as JSON lines (nothing pickled); the figures are the
    in-process ones, to the last digit, whichever worker ran which task."""
    import cluster_sim

    wl = load_workload("stationary")
    tasks = [(wl, p, 0.8, 40, 3.0, seed) for seed in (1, 2) for p in ("static", "cellflip", "oracle")]
    pool = cluster_sim.Workers(2)
    try:
        remote = [r for rs in pool.map(tasks) for r in rs]
    finally:
        pool.close()
    local = [r for t in tasks for r in cluster_sim._run(t)]
    assert "cellflip@reprefill" in [r.policy for r in local]  # cellflip's task brings its paired twin
    assert [r.policy for r in remote] == [r.policy for r in local]
    assert [r.metrics() for r in remote] == [r.metrics() for r in local]
    assert [r.series for r in remote] == [r.series for r in local]
    assert all(p.returncode == 0 for p in pool.procs)


@pytest.mark.slow
def test_a_worker_that_dies_fails_the_map():
    import cluster_sim

    pool = cluster_sim.Workers(1)
    try:
        pool.procs[0].stdin.write("not json\n")  # the worker raises on it and exits
        pool.procs[0].stdin.flush()
        with pytest.raises(RuntimeError, match="exited"):
            pool.map([(tiny(), "static", 0.5, 2, 1.0, 0)])
    finally:
        for p in pool.procs:
            p.kill()
            p.wait(timeout=30)


def test_the_paired_speedup_cancels_the_leads_home_advantage_and_shows_a_real_loss():
    """`speedup_vs_flip_reprefill`: the mean of both ways of pairing. A lead that wins by 0.3 %
    whichever mode leads is a home advantage (1.000); a loss both ways is a real one (control)."""
    import cluster_sim
    from sim.run import RunResult

    def run(policy, v):
        return RunResult(policy, 1, 1.0, 0.0, 0.0, v, 0.0, 0.0, 0, 0, 0.0, [], 0.0, {}, 0, 0, 0.0)

    def runs(cf, cf_at_rp, rp_at_kv, rp):
        return {"cellflip": [run("cellflip", cf)], "cellflip@reprefill": [run("cellflip@reprefill", cf_at_rp)],
                "flip_reprefill@kv": [run("flip_reprefill@kv", rp_at_kv)], "flip_reprefill": [run("flip_reprefill", rp)]}

    home = runs(100.3, 100.0, 99.7, 100.0)
    assert cluster_sim.paired_ratios(home) == {"on_cellflip_flips": [1.003], "on_reprefill_flips": [0.997], "mean": 1.0}
    assert cluster_sim.paired_speedup(home) == 1.0
    loss = runs(99.0, 100.0, 99.0, 100.0)
    assert cluster_sim.paired_speedup(loss) == 0.99

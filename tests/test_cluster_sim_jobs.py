"""Several RL jobs on the cluster simulator (bench/sim/jobs*.py): small runs of each workload,
the multi-job bound above every policy, and the judge's rl_jobs section."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import judge  # noqa: E402
from sim.jobbench import simulate_jobs_workload  # noqa: E402
from sim.jobrun import run_jobs  # noqa: E402
from sim.jobs import AWAY, JOB_WORKLOADS, Job, JobSpec, JobsWorkload  # noqa: E402
from sim.jobs_bound import jobs_upper_bound  # noqa: E402

CELLS = 40
QUIET = lambda *a, **k: None  # noqa: E731


def test_arrivals_follow_the_rate_and_the_window():
    jw = JOB_WORKLOADS["arrive_leave"]
    a, b = (Job(s, jw, 1000) for s in jw.jobs)
    assert b.arrivals(0.0, 12 * 3600.0) == 0 and b.arrivals(36 * 3600.0, 48 * 3600.0) == 0
    assert b.arrivals(12 * 3600.0, 13 * 3600.0) == pytest.approx(b.rate * 3600.0, abs=1)
    ph = JOB_WORKLOADS["anti_phase"]
    x, y = (Job(s, ph, 1000) for s in ph.jobs)
    peak = 1.5 * 3600.0  # a quarter of the 6 h period: x at its top, y at its bottom
    assert x.arrivals(peak - 60, peak) == pytest.approx(1.6 * x.rate * 60, abs=1)
    assert y.arrivals(peak - 60, peak) == pytest.approx(0.4 * y.rate * 60, abs=1)
    total = sum(x.arrivals(t - 60.0, t) for t in range(60, 6 * 3600 + 1, 60))
    assert total == pytest.approx(x.rate * 6 * 3600.0, abs=2)  # whole periods: the mean rate


def test_cells_stay_with_one_job_and_mins_hold():
    seen = []

    def on_tick(states, owner, t):
        held = [set(st.cl.held().tolist()) for st in states]
        assert all(not (h & g) for i, h in enumerate(held) for g in held[i + 1:]), "a cell in two jobs"
        for st in states:
            assert not st.cl.inflight[st.cl.role == AWAY].any()
            if st.job.active(t):
                assert len(st.cl.held()) >= st.job.min_cells
        seen.append(sum(len(h) for h in held))

    r = run_jobs(JOB_WORKLOADS["arrive_leave"], CELLS, 48, seed=1, check=True, on_tick=on_tick)
    assert max(seen) <= CELLS
    assert r.min_share_violation_s == 0
    assert r.cross_job_moves > 0
    assert r.jain_fairness is not None and r.jain_fairness > 0.95  # both saturated 12-36 h, equal weights


@pytest.mark.parametrize("name", list(JOB_WORKLOADS))
def test_each_workload_small_run_within_its_bound(name):
    jw, cells = JOB_WORKLOADS[name], 24
    hours = 40.0 if name == "arrive_leave" else 18.0  # past B's departure at 36 h; three 6 h periods
    jobs = [Job(s, jw, cells) for s in jw.jobs]
    top = jobs_upper_bound(jobs, cells, hours, buckets=36).tokens_per_hour
    even = {j.name: cells // len(jobs) for j in jobs}
    cf = run_jobs(jw, cells, hours, seed=1, check=True)
    st = run_jobs(jw, cells, hours, seed=1, split=even)
    assert cf.min_share_violation_s == 0 and st.min_share_violation_s == 0
    assert top >= cf.trained_tokens_per_hour and top >= st.trained_tokens_per_hour
    assert cf.trained_tokens_per_hour > 0.9 * st.trained_tokens_per_hour
    if name != "three_stationary":
        assert cf.cross_job_moves > 0


def test_untrained_tokens_are_what_was_decoded_and_never_trained():
    """Per job, decoded minus trained (in flight, waiting or in the running step at the horizon,
    or dropped): > 0 at a horizon that cuts sessions, and it falls when the horizon is moved
    past the last arrival, so that its sessions finish (the same job cut at 6 h against run to 20 h)."""
    jw = JobsWorkload("one", (JobSpec("a", "stationary", 2.0, end_h=6.0),))
    cut = run_jobs(jw, CELLS, 6.0, seed=1).per_job["a"]
    late = run_jobs(jw, CELLS, 20.0, seed=1).per_job["a"]
    assert cut["untrained_tokens_per_hour"] > 0
    assert late["untrained_tokens_per_hour"] * 20.0 < cut["untrained_tokens_per_hour"] * 6.0


def test_the_bench_block_of_a_tiny_fleet():
    block = simulate_jobs_workload(JOB_WORKLOADS["anti_phase"], 16, 8.0, (1,), 4, 2, log=QUIET)
    assert block["static_split"]["a"] + block["static_split"]["b"] == 16
    assert block["upper_bound"] >= max(block["cellflip_tokens_per_hour"], block["static_tokens_per_hour"])
    assert block["upper_bound"] >= block["static_split_bound"] >= block["static_tokens_per_hour"]
    assert block["min_share_violation_s"] == 0
    assert set(block) >= {"speedup_vs_static_partition", "upper_bound", "gain_capture", "min_share_violation_s",
                          "cross_job_moves", "jain_fairness", "gain_possible"}
    if block["gain_possible"]:
        top, c, s = block["upper_bound"], block["cellflip_tokens_per_hour"], block["static_tokens_per_hour"]
        assert block["gain_capture"] == pytest.approx((c - s) / (top - s), abs=1e-3)


def test_bound_above_every_policy_and_a_bound_missing_a_job_is_caught():
    jw = JOB_WORKLOADS["anti_phase"]
    jobs = [Job(s, jw, CELLS) for s in jw.jobs]
    top = jobs_upper_bound(jobs, CELLS, 12.0, buckets=36).tokens_per_hour
    runs = [run_jobs(jw, CELLS, 12.0, seed=1),
            run_jobs(jw, CELLS, 12.0, seed=1, split={"a": CELLS // 2, "b": CELLS // 2}),
            run_jobs(jw, CELLS, 12.0, seed=2, split={"a": CELLS - 4, "b": 4})]
    assert all(r.trained_tokens_per_hour <= top for r in runs)
    # negative control: a "bound" that leaves job b out is beaten, so the assertion can fail
    half = jobs_upper_bound(jobs[:1], CELLS, 12.0, buckets=36).tokens_per_hour
    assert any(r.trained_tokens_per_hour > half for r in runs)


def test_a_job_arriving_too_late_for_a_batch_adds_nothing_to_the_bound():
    """Job b arrives 0.8 h before the horizon: no batch of its sessions can finish (its warm-up
    from its arrival, bound.first_step_s: 12 h), so the bound is job a's alone; without the
    warm-up the fluid trains b's early finishers (0.5 % looser); a run trains none of b's."""
    jw = JobsWorkload("late", (JobSpec("a", "stationary", 0.02), JobSpec("b", "stationary", 2.0, start_h=11.2)))
    jobs = [Job(s, jw, CELLS) for s in jw.jobs]
    both = jobs_upper_bound(jobs, CELLS, 12.0, buckets=36).tokens_per_hour
    alone = jobs_upper_bound(jobs[:1], CELLS, 12.0, buckets=36).tokens_per_hour
    loose = jobs_upper_bound(jobs, CELLS, 12.0, buckets=36, warmup=False).tokens_per_hour
    assert both == pytest.approx(alone, rel=5e-4) and loose > 1.003 * both
    r = run_jobs(jw, CELLS, 12.0, seed=1)
    assert r.trained_tokens_per_hour <= both
    assert r.per_job["b"]["trained_tokens_per_hour"] == 0


def test_static_split_never_moves_cells():
    r = run_jobs(JOB_WORKLOADS["anti_phase"], CELLS, 12.0, seed=1, split={"a": 20, "b": 20})
    assert r.cross_job_moves == 0 and r.free_moves == 0
    assert all(v["mean_cells"] == 20 for v in r.per_job.values())


def test_bad_job_workload_refused():
    jw = JobsWorkload("bad", (JobSpec("a", "no_such_workload", 0.5),))
    with pytest.raises(Exception, match="no_such_workload"):
        run_jobs(jw, CELLS, 1.0)


def test_judge_takes_the_rl_jobs_section_for_its_flag():
    assert judge.variant_of("cluster_sim", ["--rl-jobs", "--quick"]) == "rl_jobs"
    assert judge.variant_of("cluster_sim", ["--quick"]) is None
    good = {"job_workloads": {"anti_phase": {"gain_capture": 0.8, "min_share_violation_s": 0},
                              "arrive_leave": {"gain_capture": 0.9, "min_share_violation_s": 0},
                              "three_stationary": {"speedup_vs_static_partition": 1.0, "gain_capture": 0.8,
                                                   "min_share_violation_s": 0}}}
    _, ok = judge.judge(good, "cluster_sim", True, variant="rl_jobs")
    assert ok
    bad = {"job_workloads": {**good["job_workloads"],
                             "anti_phase": {"gain_capture": 0.5, "min_share_violation_s": 120.0}}}
    targets, ok = judge.judge(bad, "cluster_sim", True, variant="rl_jobs")
    assert not ok and not targets["anti_phase_gain_capture"]["met"] and not targets["min_share_violation_s"]["met"]
    # the single-job section does not apply to the jobs result (it would miss every target)
    _, single_ok = judge.judge(good, "cluster_sim", True)
    assert not single_ok

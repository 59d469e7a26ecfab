"""Per-job training on a fleet shared by several RL jobs (docs/JOBS.md): each job's trainer
demand and flips, the division counting training demand, each job's staleness bound and
objective, model enforcement, a cell registering into a chosen job. Fake cells."""

from __future__ import annotations

import pytest

from tests.scheduler.sched_fakes import FakeCell, Harness, pump

REPORT = {"batch_size": 1, "steps_in_progress": 0, "max_cells_per_step": 1}


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


def _job(h, name: str, model: str = "fleet", **kw) -> dict:
    r = h.client.post("/v1/jobs", json={"name": name, "model": model, **kw})
    assert r.status_code == 201, r.text
    return r.json()


def _token(h, scope: str, job: str) -> dict:
    r = h.client.post("/v1/tokens", json={"scope": scope, "job": job})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def _fleet(h, n: int, **extra) -> list[FakeCell]:
    cells = [FakeCell(h.client, f"c{i}", max_running=4) for i in range(n)]
    for c in cells:
        c.register(**extra), c.sync()
    return cells


def _into(h, job: str, *cell_ids: str) -> None:
    """Record cells under `job` (what a finished move or a registration with --job leaves)."""
    with h.ctl.txn():
        for cid in cell_ids:
            h.ctl.store.jobs.assign("cell", cid, job)
    h.ctl.jobs.forget_members()


def _session(h, cells, session: str, auth: dict, finish: dict | None = None) -> None:
    """One turn of `session` under `auth`, finished by the trainer token `finish` when given."""
    fut = h.complete({"prompt_ids": [4, 5, 6], "max_tokens": 3}, session=session, headers=auth)
    pump(cells, until=fut, rounds=500)
    assert fut.result(timeout=60).status_code == 200
    if finish is not None:
        r = h.client.post(f"/v1/sessions/{session}/finish", json={"reward": 1.0, "group_id": session}, headers=finish)
        assert r.status_code == 200, r.text


def test_a_jobs_trainer_report_is_its_own(harness):
    h = harness
    _job(h, "alpha")
    r = h.client.post("/v1/trainer/report", json={**REPORT, "batch_size": 8}, headers=_token(h, "trainer", "alpha"))
    assert r.status_code == 200, r.text
    assert h.ctl.rates.trainer("alpha").demand.batch_size == 8
    assert h.ctl.rates.demand is None  # the fleet's (the implicit job's) trainer did not report
    h.client.post("/v1/trainer/report", json={**REPORT, "batch_size": 3}, headers=h.auth("trainer"))
    assert (h.ctl.rates.demand.batch_size, h.ctl.rates.trainer("alpha").demand.batch_size) == (3, 8)


def test_each_job_plans_its_own_flips_from_its_own_demand(harness):
    h = harness
    cells = _fleet(h, 4)
    _job(h, "beta")
    _into(h, "beta", "c2", "c3")
    agent, trainer = _token(h, "agent", "beta"), _token(h, "trainer", "beta")
    _session(h, cells, "b1", agent, finish=trainer)  # one batch of beta's ready to train
    h.clock.advance(1.5), h.tick()
    assert h.ctl.store.fleet.flipping_cells() == set()  # beta's trainer has not declared its demand
    assert h.client.post("/v1/trainer/report", json=REPORT, headers=trainer).status_code == 200
    h.clock.advance(1.5), h.tick()
    flipping = h.ctl.store.fleet.flipping_cells()
    assert len(flipping) == 1 and flipping <= {"c2", "c3"}, flipping  # beta's cell, for beta's batch
    # the implicit job's trainer reporting the same demand flips none of its cells: no batch of its own
    h.client.post("/v1/trainer/report", json=REPORT, headers=h.auth("trainer"))
    h.clock.advance(1.5), h.tick()
    assert h.ctl.store.fleet.flipping_cells() <= {"c2", "c3"}


def test_the_division_counts_each_jobs_training_demand(harness):
    h = harness
    cells = _fleet(h, 6)
    _job(h, "a")
    agent = _token(h, "agent", "a")
    for i in range(4):
        _session(h, cells, f"a{i}", agent)  # four open sessions of `a`: one cell of slots
    ctl = h.ctl
    ctl.jobs.auto_move = False

    def target() -> int:
        h.clock.advance(1.5)
        ctl.jobs.step()
        return ctl.jobs.targets["a"]

    assert target() <= 1  # control: no training measured, the sessions' slots alone
    roll = ctl.rates.job("a")
    roll.finishes, roll.occupied_slot_s = 1.0, 10.0  # measured: a session holds a slot 10 s
    ctl.rates.trainer("a").train_rate_per_cell_s = 0.05  # measured: 20 cell-seconds of training a session
    # demand: 4 / 4 slots + 4 / 10 s x 20 = 9 cells: `a` takes the whole idle fleet
    assert target() == 6
    ctl.rates.trainer("a").train_rate_per_cell_s = 0.0
    assert target() <= 1


def test_a_jobs_staleness_bound_and_objective_apply_to_it_alone(harness):
    h = harness
    cells = _fleet(h, 2)
    _job(h, "alpha", settings={"staleness_bound": 0, "objective": {"clip_high": 0.28}})
    _job(h, "beta", settings={"objective": "rloo"})
    view = h.client.get("/v1/jobs/alpha", headers=_token(h, "trainer", "alpha")).json()["trainer"]
    assert view["objective"] == {"clip_high": 0.28} and view["staleness_bound"] == 0
    beta = h.client.get("/v1/jobs/beta").json()["trainer"]
    assert beta["objective"] == {"advantage": {"type": "rloo"}}
    assert beta["staleness_bound"] == h.ctl.cfg.staleness_bound > 0  # the fleet's, unset
    ta, tb = _token(h, "trainer", "alpha"), _token(h, "trainer", "beta")
    aa, ab = _token(h, "agent", "alpha"), _token(h, "agent", "beta")
    for t in (ta, tb):
        h.client.post("/v1/trainer/report", json=REPORT, headers=t)
    _session(h, cells, "a1", aa, finish=ta)
    _session(h, cells, "b1", ab, finish=tb)
    # alpha: (0 + 1) x 1 = 1 session untrained at most, counted in its own work only
    r = h.complete({"prompt_ids": [1], "max_tokens": 2}, session="a2", headers=aa).result(timeout=20)
    assert r.status_code == 429 and r.json()["reason"] == "staleness_bound", r.text
    _session(h, cells, "b2", ab)  # control: beta, the same batch and work, under the fleet's bound
    _session(h, cells, "d1", h.auth("agent"))  # and the implicit job, whose trainer never reported
    # alpha's trainer fetches its trajectory: its own cursor advances, its work drops below the bound
    got = h.client.get("/v1/trajectories", headers=ta).json()["trajectories"]
    assert [t["id"] for t in got] == ["a1"]
    assert h.ctl.staleness.finished_waiting("alpha") == 0 and h.ctl.staleness.finished_waiting("beta") == 1
    _session(h, cells, "a2", aa)
    r = h.client.post("/v1/jobs", json={"name": "bad", "model": "x", "settings": {"staleness_bound": -1}})
    assert r.status_code == 422


def test_model_enforcement(harness):
    h = harness
    c0, c1 = _fleet(h, 2, model="tiny")  # the implicit job's first cell tells the fleet's model
    _job(h, "big", model="org/big-model")
    _job(h, "small", model="tiny")
    _job(h, "nobody", model="org/none", min_cells=1)
    jobs = {j["name"]: j for j in h.client.get("/v1/jobs").json()["jobs"]}
    assert {n: j["model_cells"] for n, j in jobs.items()} == {"default": 2, "big": 0, "small": 2, "nobody": 0}
    r = h.client.post("/v1/jobs/big/cells", json={"cell": "c0"})
    assert r.status_code == 409 and r.json()["reason"] == "model_mismatch", r.text
    assert "org/big-model" in r.json()["detail"] and "tiny" in r.json()["detail"]
    assert h.client.post("/v1/jobs/small/cells", json={"cell": "c1"}).status_code == 202  # control: same model
    # a cell of the big model registers into its job; the fleet's own job refuses it
    c2 = FakeCell(h.client, "c2", max_running=4)
    c2.register(model="org/big-model", job="big"), c2.sync()
    assert h.ctl.store.jobs.job_of("cell", "c2") == "big"
    c3 = FakeCell(h.client, "c3", max_running=4)
    r = c3.register(expect=409, model="org/big-model", job="default")
    assert r["reason"] == "model_mismatch"
    h.ctl.jobs.auto_move = False
    h.clock.advance(1.5), h.tick()
    targets = h.ctl.jobs.targets
    assert targets["nobody"] == 0 and targets["big"] <= 1  # no live cell of its model: target 0, min or not


def test_a_cell_registers_into_a_chosen_job_or_is_refused(harness):
    h = harness
    _job(h, "gamma")
    _job(h, "leaving")
    h.client.delete("/v1/jobs/leaving")
    for job, status, reason in (("nope", 404, "unknown_job"), ("leaving", 409, "job_draining")):
        c = FakeCell(h.client, f"x-{job}")
        assert c.register(expect=status, job=job)["reason"] == reason
        assert h.ctl.store.fleet.get_cell(f"x-{job}") is None  # refused before anything was recorded
    c = FakeCell(h.client, "g0")
    c.register(job="gamma"), c.sync()
    assert h.client.get("/v1/cells/g0").json()["job"] == "gamma"
    c.incarnation = "again"  # a later registration without a job keeps the recorded one
    h.clock.advance(10.0), h.tick()
    c.register(), c.sync()
    assert h.ctl.store.jobs.job_of("cell", "g0") == "gamma"


def test_cellflip_cell_takes_a_job(capsys):
    from cells.cli import main

    with pytest.raises(SystemExit):
        main(["cell", "--help"])
    assert "--job JOB" in capsys.readouterr().out


def test_a_jobs_hand_out_applies_its_own_bound_in_its_own_lineage(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"), staleness_policy="drop")
    try:
        cells = _fleet(h, 2)
        _job(h, "alpha", settings={"staleness_bound": 0})
        _job(h, "beta")
        ta, tb = _token(h, "trainer", "alpha"), _token(h, "trainer", "beta")
        _session(h, cells, "a1", _token(h, "agent", "alpha"), finish=ta)  # sampled at version 0
        _session(h, cells, "b1", _token(h, "agent", "beta"), finish=tb)
        for v, t in ((1, ta), (2, tb), (3, tb)):
            assert h.client.post("/v1/versions", json={"version": v}, headers=t).status_code == 201
        assert h.ctl.staleness.finished_waiting() == 2  # the fleet's count (its one-job planner's)
        (a,) = h.client.get("/v1/trajectories", headers=ta).json()["trajectories"]
        (b,) = h.client.get("/v1/trajectories", headers=tb).json()["trajectories"]
        # alpha: one version of its own newer (not three), past its bound 0: dropped
        assert (a["id"], a["staleness"], a.get("dropped")) == ("a1", 1, "stale")
        # control: beta's two versions newer, within the fleet's bound: handed out whole
        assert (b["id"], b["staleness"], b.get("dropped")) == ("b1", 2, None) and b["loss_mask"]
        # each job's fetch moves its own cursor, and the fleet's (a one-job planner's backlog) too
        assert [h.ctl.staleness.finished_waiting(j) for j in (None, "alpha", "beta")] == [0, 0, 0]
    finally:
        h.close()

"""RL jobs on one fleet (docs/JOBS.md): durable jobs, drain-then-delete, job-bound agent and
trainer tokens, the gateway's routing by `model`, per-job admission and version lineages."""

from __future__ import annotations

import pytest

from tests.scheduler.sched_fakes import FakeCell, Harness, pump, until_held

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


def _job(h, name: str, **kw) -> dict:
    r = h.client.post("/v1/jobs", json={"name": name, "model": "toy", **kw})
    assert r.status_code == 201, r.text
    return r.json()


def _token(h, scope: str, job: str | None = None) -> dict:
    body = {"scope": scope} if job is None else {"scope": scope, "job": job}
    r = h.client.post("/v1/tokens", json=body)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def _generate(h, cell: FakeCell, session: str, auth: dict):
    fut = h.complete({"prompt_ids": [4, 5, 6], "max_tokens": 3}, session=session, headers=auth)
    until_held(cell, fut)
    pump([cell], until=fut)
    return fut.result(timeout=60)


def test_jobs_are_durable_and_admin_only(tmp_path):
    db = str(tmp_path / "sched.sqlite")
    h = Harness(db)
    try:
        assert [j["name"] for j in h.client.get("/v1/jobs").json()["jobs"]] == ["default"]
        _job(h, "math", min_cells=1, max_cells=3, weight=2.0, settings={"objective": "grpo", "staleness_bound": 2})
        assert h.client.post("/v1/jobs", json={"name": "math", "model": "toy"}).status_code == 409
        assert h.client.post("/v1/jobs", json={"name": "Bad Name", "model": "toy"}).status_code == 422
        assert h.client.post("/v1/jobs", json={"name": "x", "model": "toy", "min_cells": 3,
                                                "max_cells": 1}).status_code == 422
        assert h.client.post("/v1/jobs", json={"name": "x", "model": "toy",
                                                "settings": {"nonsense": 1}}).status_code == 422
        # a trainer token cannot create or delete jobs (admin scope)
        trainer = h.auth("trainer")
        r = h.client.post("/v1/jobs", json={"name": "evil", "model": "toy"}, headers=trainer)
        assert r.status_code == 403
        assert h.client.delete("/v1/jobs/math", headers=trainer).status_code == 403
        assert h.client.delete("/v1/jobs/default").status_code == 409
        math_token = _token(h, "agent", "math")
    finally:
        h.close()
    h = Harness(db)  # a restarted scheduler has the job, and the token is still bound to it
    try:
        j = h.client.get("/v1/jobs/math").json()
        assert (j["min_cells"], j["max_cells"], j["weight"], j["state"]) == (1, 3, 2.0, "active")
        assert j["settings"] == {"objective": "grpo", "staleness_bound": 2}
        r = h.client.post("/v1/chat/completions", json={**CHAT, "model": "default"},
                          headers={**math_token, "X-Session-Id": "s1"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_job", r.text
    finally:
        h.close()


def test_tokens_of_a_job_reach_only_that_job(harness):
    h = harness
    cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
    cell.register(), cell.sync()
    _job(h, "alpha"), _job(h, "beta")
    a, b = _token(h, "agent", "alpha"), _token(h, "agent", "beta")
    assert h.client.post("/v1/tokens", json={"scope": "cell", "job": "alpha"}).status_code == 422
    assert h.client.post("/v1/tokens", json={"scope": "agent", "job": "nope"}).status_code == 404
    assert _generate(h, cell, "sa", a).status_code == 200
    assert _generate(h, cell, "sd", h.auth("agent")).status_code == 200
    jobs = h.ctl.store.jobs
    assert jobs.job_of("session", "sa") == "alpha"
    assert jobs.job_of("session", "sd") == "default"  # negative control: an unbound token's session
    # beta's token: alpha's session does not exist for it; alpha's model name is another job's
    assert h.client.get("/v1/sessions/sa", headers=b).status_code == 404
    r = h.client.post("/v1/chat/completions", json={**CHAT, "model": "alpha"}, headers={**b, "X-Session-Id": "x"})
    assert r.status_code == 403 and "beta" in r.json()["error"]["message"]
    # several jobs: a model naming none of them is a clear 404 for a caller bound to none (admin)
    r = h.client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}, headers={"X-Session-Id": "y"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job"
    assert "alpha" in r.json()["error"]["message"]
    # admin may run a turn of any job, but not move a session between jobs
    r = h.client.post("/v1/chat/completions", json={**CHAT, "model": "beta"}, headers={"X-Session-Id": "sa"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_job"
    view = h.client.get("/v1/jobs/alpha").json()
    assert view["open_sessions"] == 1


def test_draining_job_takes_no_new_session_and_is_deleted_once_idle(harness):
    h = harness
    cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
    cell.register(), cell.sync()
    _job(h, "gone", settings={"max_sessions": 1})
    tok = _token(h, "agent", "gone")
    assert _generate(h, cell, "g1", tok).status_code == 200
    r = h.client.post("/v1/generate", json={"prompt_ids": [1, 2]}, headers={**tok, "X-Session-Id": "g2"})
    assert r.status_code == 429 and r.json()["reason"] == "job_full"  # max_sessions 1: g1 is open
    fut = h.complete({"prompt_ids": [7, 8], "max_tokens": 4}, session="g1", headers=tok)  # a turn in flight
    until_held(cell, fut)
    assert h.client.delete("/v1/jobs/gone").json()["state"] == "draining"
    h.clock.advance(2.0), h.tick()
    assert h.client.get("/v1/jobs/gone").json()["state"] == "draining"  # a turn is in flight
    r = h.client.post("/v1/generate", json={"prompt_ids": [1, 2]}, headers={**tok, "X-Session-Id": "g3"})
    assert r.status_code == 409 and r.json()["reason"] == "job_draining"
    pump([cell], until=fut)
    assert fut.result(timeout=60).status_code == 200  # the live rollout finished
    h.clock.advance(2.0), h.tick()
    assert h.client.get("/v1/jobs/gone").status_code == 404
    assert "gone" not in [j["name"] for j in h.client.get("/v1/jobs").json()["jobs"]]
    assert h.ctl.store.jobs.get("gone").state == "deleted"
    # the name can be used again
    _job(h, "gone")


def test_each_job_has_its_own_version_lineage_view(harness):
    h = harness
    _job(h, "alpha")
    ta, td = _token(h, "trainer", "alpha"), h.auth("trainer")
    assert h.client.post("/v1/versions", json={"version": 1}, headers=td).status_code == 201
    assert h.client.post("/v1/versions", json={"version": 2}, headers=ta).status_code == 201
    mine = [v["version"] for v in h.client.get("/v1/versions", headers=ta).json()["versions"]]
    theirs = [v["version"] for v in h.client.get("/v1/versions", headers=td).json()["versions"]]
    admin = [v["version"] for v in h.client.get("/v1/versions").json()["versions"]]
    assert (mine, theirs, admin) == ([2], [1], [1, 2])
    jobs = {j["name"]: j for j in h.client.get("/v1/jobs").json()["jobs"]}
    assert jobs["alpha"]["versions"] == [2] and jobs["default"]["versions"] == [1]
    # a trainer token sees its own job only
    assert [j["name"] for j in h.client.get("/v1/jobs", headers=ta).json()["jobs"]] == ["alpha"]
    assert h.client.get("/v1/jobs/default", headers=ta).status_code == 403


def test_single_job_fleet_routes_any_model_name_to_default(harness):
    h = harness
    r = h.client.post("/v1/chat/completions", json={**CHAT, "model": "cellflip"}, headers={"X-Session-Id": "q"})
    assert r.status_code != 404, r.text  # no cell: refused for capacity, not for the model name
    h.tick()
    metrics = h.client.get("/metrics").text
    assert 'cellflip_job_target_cells{job="default"} 0.0' in metrics
    assert 'cellflip_job_cells{job="default"} 0.0' in metrics
    _job(h, "beta")  # several jobs: their open sessions are counted
    h.clock.advance(2.0), h.tick()
    metrics = h.client.get("/metrics").text
    assert 'cellflip_job_open_sessions{job="default"} 0.0' in metrics  # the turn was refused before any record
    assert 'cellflip_job_open_sessions{job="beta"} 0.0' in metrics


def test_a_jobs_trainer_sees_and_trains_on_its_own_sessions_only(harness):
    h = harness
    cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
    cell.register(), cell.sync()
    _job(h, "alpha")
    agent_a, trainer_a, trainer_d = _token(h, "agent", "alpha"), _token(h, "trainer", "alpha"), h.auth("trainer")
    assert _generate(h, cell, "sa", agent_a).status_code == 200
    assert _generate(h, cell, "sd", h.auth("agent")).status_code == 200
    finish = {"reward": 1.0, "group_id": "g"}
    assert h.client.post("/v1/sessions/sd/finish", json=finish, headers=trainer_a).status_code == 404
    assert h.client.get("/v1/sessions/sd", headers=trainer_a).status_code == 404
    assert h.client.post("/v1/sessions/sa/finish", json=finish, headers=trainer_a).status_code == 200
    assert h.client.post("/v1/sessions/sd/finish", json=finish, headers=trainer_d).status_code == 200

    def ids(headers):
        return [t["id"] for t in h.client.get("/v1/trajectories", headers=headers).json()["trajectories"]]

    assert (ids(trainer_a), ids(trainer_d), sorted(ids({}))) == (["sa"], ["sd"], ["sa", "sd"])


def test_a_drain_survives_a_restart(tmp_path):
    db = str(tmp_path / "sched.sqlite")
    h = Harness(db)
    try:
        _job(h, "gone")
        tok = _token(h, "agent", "gone")
        cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
        cell.register(), cell.sync()
        fut = h.complete({"prompt_ids": [7, 8], "max_tokens": 4}, session="g1", headers=tok)
        until_held(cell, fut)
        assert h.client.delete("/v1/jobs/gone").json()["state"] == "draining"
        pump([cell], until=fut)
    finally:
        h.close()
    h = Harness(db)
    try:
        assert h.ctl.store.jobs.get("gone").state == "draining"  # durable
        r = h.client.post("/v1/generate", json={"prompt_ids": [1]}, headers={**tok, "X-Session-Id": "g2"})
        assert r.status_code == 409 and r.json()["reason"] == "job_draining"
        h.clock.advance(6.0), h.tick(2)  # past the restart's grace: the loop acts again
        assert h.ctl.store.jobs.get("gone").state == "deleted"
    finally:
        h.close()

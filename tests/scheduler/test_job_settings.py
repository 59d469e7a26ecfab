"""Each RL job's own `min_rollout_cells` and `staleness_policy` (docs/JOBS.md "Job settings"):
defaults from the fleet's config, checked on create and on `PATCH /v1/jobs/{name}` (a bad value
is a 422 and changes nothing), kept across a restart, and applied: a job's flips keep its own
rollout cells (explicit ones and the planner's snapshot), its trajectories past its bound follow
its own policy. Fake cells."""

from __future__ import annotations

from tests.scheduler.sched_fakes import Harness
from tests.scheduler.test_job_training import _fleet, _into, _job, _session, _token


def test_settings_default_to_the_fleets_and_bad_ones_change_nothing(tmp_path):
    db = str(tmp_path / "sched.sqlite")
    h = Harness(db, staleness_policy="drop", min_rollout_cells=1)
    try:
        view = _job(h, "alpha", max_cells=3)["trainer"]
        assert (view["min_rollout_cells"], view["staleness_policy"]) == (1, "drop")  # the fleet's
        bad = [{"staleness_policy": "ignore"}, {"staleness_policy": 1}, {"min_rollout_cells": -1},
               {"min_rollout_cells": True}, {"min_rollout_cells": "2"}, {"min_rollout_cells": 4}]
        for settings in bad:
            r = h.client.post("/v1/jobs", json={"name": "beta", "model": "fleet", "max_cells": 3, "settings": settings})
            assert r.status_code == 422, (settings, r.text)
            assert "settings." in r.json()["detail"], r.text  # names the setting
            r = h.client.patch("/v1/jobs/alpha", json={"settings": settings})
            assert r.status_code == 422, (settings, r.text)
        assert h.client.get("/v1/jobs/beta").status_code == 404  # no job was created
        assert h.client.get("/v1/jobs/alpha").json()["settings"] == {}  # nothing changed
        assert h.client.patch("/v1/jobs/alpha", json={"settings": {}}).status_code == 422
        assert h.client.patch("/v1/jobs/nope", json={"settings": {"min_rollout_cells": 1}}).status_code == 404
        r = h.client.patch("/v1/jobs/alpha", json={"settings": {"min_rollout_cells": 2}}, headers=h.auth("trainer"))
        assert r.status_code == 403  # admin only
        r = h.client.patch("/v1/jobs/alpha", json={"settings": {"min_rollout_cells": 2, "staleness_policy": "correct"}})
        assert r.status_code == 200, r.text
        assert (r.json()["trainer"]["min_rollout_cells"], r.json()["trainer"]["staleness_policy"]) == (2, "correct")
    finally:
        h.close()
    h = Harness(db, staleness_policy="drop", min_rollout_cells=1)  # durable
    try:
        assert h.client.get("/v1/jobs/alpha").json()["settings"] == {"min_rollout_cells": 2,
                                                                      "staleness_policy": "correct"}
        r = h.client.patch("/v1/jobs/alpha", json={"settings": {"staleness_policy": None}})  # back to the fleet's
        assert r.json()["settings"] == {"min_rollout_cells": 2} and r.json()["trainer"]["staleness_policy"] == "drop"
    finally:
        h.close()


def test_a_jobs_flips_keep_its_own_min_rollout_cells(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"), min_rollout_cells=1)
    try:
        cells = _fleet(h, 4)
        _job(h, "alpha", settings={"min_rollout_cells": 2})
        _job(h, "beta")
        _into(h, "alpha", "c0", "c1", "c2")
        _into(h, "beta", "c3")
        ta, tb = _token(h, "trainer", "alpha"), _token(h, "trainer", "beta")
        snaps = h.ctl.jobs.planner.snapshots(["alpha", "beta"], h.ctl.jobs.members())
        assert (snaps["alpha"].min_rollout_cells, snaps["beta"].min_rollout_cells) == (2, 1)  # the planner's too
        assert h.client.post("/v1/flips", json={"to": "training", "cell": "c0"}, headers=ta).status_code == 202
        r = h.client.post("/v1/flips", json={"to": "training", "cell": "c1"}, headers=ta)
        assert r.status_code == 409 and r.json()["reason"] == "min_rollout_cells", r.text
        assert "alpha" in r.json()["detail"] and "2" in r.json()["detail"]
        # beta's one cell: its own floor (the fleet's 1) holds it, though alpha's cells serve
        r = h.client.post("/v1/flips", json={"to": "training", "cell": "c3"}, headers=tb)
        assert r.status_code == 409 and "beta" in r.json()["detail"], r.text
        # but a move out of the job is the division's (or an admin's) call: its drain is not held
        mid = h.client.post("/v1/jobs/alpha/cells", json={"cell": "c3"}).json()["id"]
        h.tick()
        assert [e[0] for e in h.ctl.store.jobs.get_move(mid).history] == ["draining", "flip_training"]
        # control: alpha's floor lowered to 1, the same flip is taken
        assert h.client.patch("/v1/jobs/alpha", json={"settings": {"min_rollout_cells": 1}}).status_code == 200
        assert h.client.post("/v1/flips", json={"to": "training", "cell": "c1"}, headers=ta).status_code == 202
        assert len(cells) == 4
    finally:
        h.close()


def test_a_jobs_hand_out_follows_its_own_staleness_policy(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"), staleness_policy="drop")
    try:
        cells = _fleet(h, 2)
        _job(h, "alpha", settings={"staleness_bound": 0, "staleness_policy": "correct"})
        _job(h, "beta", settings={"staleness_bound": 0})
        ta, tb = _token(h, "trainer", "alpha"), _token(h, "trainer", "beta")
        _session(h, cells, "a1", _token(h, "agent", "alpha"), finish=ta)  # sampled at version 0
        _session(h, cells, "b1", _token(h, "agent", "beta"), finish=tb)
        for v, t in ((1, ta), (2, tb)):
            assert h.client.post("/v1/versions", json={"version": v}, headers=t).status_code == 201
        (a,) = h.client.get("/v1/trajectories", headers=ta).json()["trajectories"]
        (b,) = h.client.get("/v1/trajectories", headers=tb).json()["trajectories"]
        # alpha: past its bound, its own policy `correct`: handed out whole, to be corrected
        assert (a["id"], a["staleness"], a.get("dropped")) == ("a1", 1, None) and a["loss_mask"]
        # control: beta, equally stale, under the fleet's `drop`
        assert (b["id"], b["staleness"], b.get("dropped")) == ("b1", 1, "stale")
        assert (h.ctl.staleness.stale_corrected, h.ctl.staleness.stale_dropped) == (1, 1)
    finally:
        h.close()

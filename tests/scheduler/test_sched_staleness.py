"""The staleness bound: admission of new sessions pauses, stale trajectories follow the policy,
dropped groups are counted; all of it visible in GET /v1/versions and /metrics."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, pump

from scheduler.control.staleness import trajectory_staleness, versions_behind


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(**sched) -> Harness:
        h = Harness(str(tmp_path / f"s{len(made)}.sqlite"), **sched)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


def _cell(h: Harness, **kw) -> FakeCell:
    c = FakeCell(h.client, "c1", **kw)
    c.register()
    c.sync()
    return c


def _roll(h: Harness, c: FakeCell, session: str, prompt=(1, 2), n: int = 2):
    fut = h.complete({"prompt_ids": list(prompt), "max_tokens": n}, session=session)
    pump([c], until=fut)
    r = fut.result(timeout=60)
    return r


def _report(h: Harness, batch_size: int) -> None:
    r = h.client.post("/v1/trainer/report", json={"batch_size": batch_size, "steps_in_progress": 0,
                                                  "max_cells_per_step": 1})
    assert r.status_code == 200, r.text


def test_versions_behind_counts_published_updates():
    assert versions_behind([3, 7, 9], 7) == 1
    assert versions_behind([3, 7, 9], 0) == 3  # an unpublished start version lags every publish
    assert versions_behind([3, 7, 9], 9) == 0
    traj = {"loss_mask": [0, 1, 1, 1], "versions": [None, 7, 9, 9]}
    assert trajectory_staleness([3, 7, 9], traj) == 1  # its oldest sampled token decides
    assert trajectory_staleness([3, 7, 9], {"loss_mask": [0], "versions": [None]}) == 0


def test_admission_pauses_new_sessions_at_the_bound(make):
    # bound 0, batch 2: at most (0 + 1) x 2 sessions in flight or finished and not yet fetched
    h = make(staleness_bound=0)
    c = _cell(h)
    _report(h, batch_size=2)
    assert _roll(h, c, "a").status_code == 200
    h.client.post("/v1/sessions/a/finish", json={"reward": 1.0, "group_id": "g"})
    assert _roll(h, c, "b").status_code == 200  # b stays open between turns (not in flight)
    assert _roll(h, c, "c").status_code == 200
    h.client.post("/v1/sessions/c/finish", json={"reward": 0.0, "group_id": "g"})
    r = h.client.post("/v1/generate", json={"prompt_ids": [1], "max_tokens": 1},
                      headers={"X-Session-Id": "d"})
    assert r.status_code == 429 and r.json()["reason"] == "staleness_bound"
    # the chat gateway records a session's prompt before its first request: still a new rollout
    h.client.portal.call(lambda: h.ctl.store.sessions.append_prompt("e", [1, 2]))
    r = h.client.post("/v1/generate", json={"prompt_ids": [1, 2], "max_tokens": 1},
                      headers={"X-Session-Id": "e"})
    assert r.status_code == 429 and r.json()["reason"] == "staleness_bound"
    assert "Retry-After" in r.headers
    # a later turn of an admitted session is never held back
    b = h.client.get("/v1/sessions/b").json()["token_ids"]
    assert _roll(h, c, "b", prompt=b + [5], n=1).status_code == 200
    st = h.client.get("/v1/versions").json()["staleness"]
    assert st["admission_paused"] == 2 and st["admission_limit"] == 2 and st["bound"] == 0
    assert "cellflip_admission_staleness_paused_total 2.0" in h.client.get("/metrics").text
    # the trainer fetches the finished work: admission opens again
    assert len(h.client.get("/v1/trajectories", params={"limit": 10}).json()["trajectories"]) == 2
    assert _roll(h, c, "d").status_code == 200


def test_admission_without_a_declared_batch_is_unbounded(make):
    h = make(staleness_bound=0)
    c = _cell(h)
    for s in ("a", "b", "c"):
        assert _roll(h, c, s).status_code == 200
        h.client.post(f"/v1/sessions/{s}/finish", json={"reward": 1.0, "group_id": "g"})
    assert h.client.get("/v1/versions").json()["staleness"]["admission_limit"] is None


def _stale_setup(h: Harness) -> None:
    c = _cell(h)  # samples under version 0
    _roll(h, c, "old")
    h.client.post("/v1/sessions/old/finish", json={"reward": 1.0, "group_id": "g"})
    for v in (1, 2, 3):  # three RL updates published since
        assert h.client.post("/v1/versions", json={"version": v}).status_code == 201


def test_stale_trajectory_trained_with_correction_is_counted(make):
    h = make(staleness_bound=2, staleness_policy="correct")
    _stale_setup(h)
    (t,) = h.client.get("/v1/trajectories").json()["trajectories"]
    assert t["staleness"] == 3 and "dropped" not in t and len(t["token_ids"]) == 4
    st = h.client.get("/v1/versions").json()["staleness"]
    assert st["stale_corrected"] == 1 and st["stale_dropped"] == 0 and st["max_seen"] == 3
    text = h.client.get("/metrics").text
    assert 'cellflip_stale_trajectories_total{policy="correct"} 1.0' in text
    assert "cellflip_trajectory_staleness_max 3.0" in text


def test_stale_trajectory_dropped_by_policy_is_handed_out_as_dropped(make):
    h = make(staleness_bound=2, staleness_policy="drop")
    _stale_setup(h)
    (t,) = h.client.get("/v1/trajectories").json()["trajectories"]
    assert t["dropped"] == "stale" and t["staleness"] == 3 and t["group_id"] == "g"
    assert "token_ids" not in t  # nothing to train on
    st = h.client.get("/v1/versions").json()["staleness"]
    assert st["stale_dropped"] == 1 and st["policy"] == "drop"
    assert 'cellflip_stale_trajectories_total{policy="drop"} 1.0' in h.client.get("/metrics").text


def test_within_the_bound_nothing_is_counted(make):
    h = make(staleness_bound=3, staleness_policy="drop")
    _stale_setup(h)
    (t,) = h.client.get("/v1/trajectories").json()["trajectories"]
    assert t["staleness"] == 3 and "dropped" not in t
    st = h.client.get("/v1/versions").json()["staleness"]
    assert st["stale_dropped"] == st["stale_corrected"] == 0


def test_dropped_groups_are_counted(make):
    h = make()
    r = h.client.post("/v1/trajectories/dropped", json={"reason": "deadline", "groups": 2, "trajectories": 5})
    assert r.status_code == 200
    assert h.client.post("/v1/trajectories/dropped",
                         json={"reason": "bogus", "groups": 1, "trajectories": 1}).status_code == 422
    text = h.client.get("/metrics").text
    assert 'cellflip_groups_dropped_total{reason="deadline"} 2.0' in text
    assert 'cellflip_group_trajectories_dropped_total{reason="deadline"} 5.0' in text

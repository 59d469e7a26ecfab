"""Bounded retention (only trajectories training is done with, oldest first, never the newest
finish number, each deletion logged and counted) and the trainer's write-back it waits for."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from sched_fakes import Harness
from storekit import random_session

from cells.trainer import outcomes
from scheduler.contract.config import CellflipConfig
from scheduler.contract.config.store import RetainConfig


@pytest.fixture
def h(tmp_path):
    os.environ.pop("CELLFLIP_READER_TOKEN", None)
    h = Harness(str(tmp_path / "s.sqlite"))
    yield h
    h.close()


def _seed(h, n: int) -> None:
    for i in range(n):
        h.client.portal.call(lambda i=i: random_session(h.ctl.store, f"run-e{i}", seed=i))


def _ids(h) -> list[str]:
    page = h.client.get("/v1/export/trajectories", params={"after": 0, "limit": 100}).json()
    return [r["session_id"] for r in page["items"]]


def test_outcomes_write_back_and_scope(h):
    _seed(h, 2)
    body = {"outcomes": {"run-e0": {"status": "trained", "update_version": 3, "advantage": 0.5},
                         "nope": {"status": "trained"}}}
    assert h.client.post("/v1/trajectories/outcomes", json=body, headers=h.auth("reader")).status_code == 403
    r = h.client.post("/v1/trajectories/outcomes", json=body, headers=h.auth("trainer")).json()
    assert r == {"recorded": 1, "unknown": 1}
    rows = h.client.get("/v1/export/trajectories", headers=h.auth("reader")).json()["items"]
    assert rows[0]["training"] == {"status": "trained", "update_version": 3, "advantage": 0.5}
    assert rows[1]["training"] is None


def test_retention_deletes_only_trained_past_the_limit_and_counts(h):
    _seed(h, 6)
    st = h.ctl.store
    trained = {f"run-e{i}": {"status": "trained"} for i in (0, 1, 3, 5)}
    h.client.post("/v1/trajectories/outcomes", json={"outcomes": trained})
    ret = h.app.state.retention
    # count 2: four over; run-e2 and run-e4 have no outcome, run-e5 holds the newest finish number
    gone = h.client.portal.call(lambda: _pass(ret, st, RetainConfig(count=2)))
    assert gone == {"count": {"sessions": 3, "tokens": gone["count"]["tokens"]}}
    assert _ids(h) == ["run-e2", "run-e4", "run-e5"]
    status = h.client.get("/v1/export/status", headers=h.auth("reader")).json()
    assert status["deleted"]["count"]["sessions"] == 3 and status["latest"] == 6
    assert 'cellflip_trajectories_deleted_total{reason="count"} 3.0' in h.client.get("/metrics").text
    # a session finished after the deletions gets a fresh finish number
    h.client.portal.call(lambda: random_session(st, "run-e9", seed=9))
    assert h.client.get("/v1/export/trajectories").json()["items"][-1]["finish_seq"] == 7
    # negative control: no limit reached, nothing goes
    assert h.client.portal.call(lambda: _pass(ret, st, RetainConfig(count=100))) == {}


def test_retention_waits_for_exports_when_asked(h):
    _seed(h, 4)
    st = h.ctl.store
    h.client.post("/v1/trajectories/outcomes", json={"outcomes": {f"run-e{i}": {"status": "trained"}
                                                                  for i in range(4)}})
    cfg = RetainConfig(count=0, require_exported=True)
    ret = h.app.state.retention
    assert h.client.portal.call(lambda: _pass(ret, st, cfg)) == {}  # no exporter has acknowledged
    assert h.client.put("/v1/export/ack", json={"name": "a", "cursor": 2},
                        headers=h.auth("reader")).json()["cursor"] == 2
    assert h.client.portal.call(lambda: _pass(ret, st, cfg))["count"]["sessions"] == 2
    assert _ids(h) == ["run-e2", "run-e3"]


def test_age_limit(h):
    _seed(h, 3)
    st = h.ctl.store
    h.client.post("/v1/trajectories/outcomes", json={"outcomes": {f"run-e{i}": {"status": "trained"}
                                                                  for i in range(3)}})
    import time

    later = time.time() + 3600
    gone = h.client.portal.call(lambda: st.retention.purge(RetainConfig(count=None, age_s=60), now=later))
    assert gone["age"]["sessions"] == 2 and _ids(h) == ["run-e2"]
    assert h.client.portal.call(lambda: st.retention.purge(RetainConfig(count=None, age_s=60))) == {}


def _pass(ret, store, cfg):
    ret.cfg = cfg
    return ret.pass_once(store)


def test_default_retention_is_stated():
    r = CellflipConfig().scheduler.store.retain_trajectories
    assert (r.count, r.age_s, r.bytes, r.require_exported) == (100_000, None, None, False)


def test_trainer_write_back_records():
    posted = []
    client = SimpleNamespace(_call=lambda m, p, json: posted.append((p, json)))
    from cells.trainer.trainer import resolved_objective

    coordinator = SimpleNamespace(objective=resolved_objective(CellflipConfig()))
    t = SimpleNamespace(client=client, version=5, rl_step=4, cfg=CellflipConfig(), coordinator=coordinator)
    batch = [{"id": f"s{i}", "group_id": "g", "reward": float(i), "loss_mask": [0, 1, 1], "versions": [None, 3, 4],
              "token_ids": [1, 2, 3], "logprobs": [None, -1.0, -1.0], "old_logprobs": [None, -1.0, -1.0],
              "provenance": [None, "exact", "exact"], "segment_starts": [0]} for i in range(2)]
    outcomes.trained(t, batch, {}, 4, None)
    (path, body), = posted[:1]
    o = body["outcomes"]
    assert path == "/v1/trajectories/outcomes" and o["s0"]["status"] == "trained" and o["s0"]["update_version"] == 5
    assert o["s0"]["staleness"] == 1 and o["s0"]["advantage"] < 0 < o["s1"]["advantage"]
    assert o["s0"]["correction"] == {"r_d_min": 1.0, "r_d_mean": 1.0, "r_d_max": 1.0, "tokens": 2, "missing": 0}
    batch[0]["old_logprobs"] = [None, -0.5, -1.0]  # the train/inference discrepancy shows
    outcomes.trained(t, batch, {}, 4, None)
    assert posted[-1][1]["outcomes"]["s0"]["correction"]["r_d_max"] > 1.0
    outcomes.dropped(t, {"deadline": [batch[0]]})
    assert posted[-1][1]["outcomes"] == {"s0": {"status": "dropped", "drop_reason": "deadline"}}


def test_a_write_back_that_cannot_be_built_never_stops_training():
    posted = []
    t = SimpleNamespace(client=SimpleNamespace(_call=lambda m, p, json: posted.append(json)), version=1, rl_step=1,
                        cfg=CellflipConfig())
    outcomes.trained(t, [{"id": "x"}], {}, 1, None)  # no token columns: logged, nothing posted
    outcomes.dropped(t, {"stale": [{"dropped": "stale"}]})  # no id: nothing to record
    assert posted == []
    broken = SimpleNamespace(_call=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("down")))
    outcomes.dropped(SimpleNamespace(client=broken), {"deadline": [{"id": "s"}]})  # the scheduler down: logged

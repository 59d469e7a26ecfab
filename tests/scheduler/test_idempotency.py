"""Idempotency-Key on the public mutating routes: one effect per key, replays answer alike,
a refused request records no key, keys expire after their ttl."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.scheduler.sched_fakes import Harness, pump
from tests.scheduler.storecheck import fleet as _fleet
from tests.scheduler.storecheck import rejected as _rejected
from tests.scheduler.storecheck import store_dump


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


def test_concurrent_replays_of_one_key_make_one_flip(harness):
    _fleet(harness, 3)
    body, key = {"cell": "c0", "to": "training"}, {"Idempotency-Key": "together"}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: harness.client.post("/v1/flips", json=body, headers=key), range(8)))
    assert {r.status_code for r in answers} == {202}
    assert len({json.dumps(r.json(), sort_keys=True) for r in answers}) == 1
    assert len(harness.client.get("/v1/flips").json()["flips"]) == 1


def test_count_flip_replay_returns_the_original_cells(harness):
    _fleet(harness, 3)
    key = {"Idempotency-Key": "by-count"}
    first = harness.client.post("/v1/flips", json={"count": 1, "to": "training"}, headers=key)
    assert first.status_code == 202
    before = store_dump(harness.db_path)
    again = harness.client.post("/v1/flips", json={"count": 1, "to": "training"}, headers=key)
    assert again.status_code == 202 and again.json() == first.json()
    assert store_dump(harness.db_path) == before
    r = _rejected(harness.client, harness.db_path, "POST", "/v1/flips", 409,
                  json={"count": 2, "to": "training"}, headers=key)
    assert r.json()["reason"] == "idempotency_key_reused"


def test_a_refused_request_records_no_key(harness):
    """Nothing half-applied: a 409 under an Idempotency-Key stores neither a flip nor the key,
    so the key is still free for the corrected request."""
    _fleet(harness, 2)
    key = {"Idempotency-Key": "retry-me"}
    _rejected(harness.client, harness.db_path, "POST", "/v1/flips", 409, json={"cell": "c0", "to": "rollout"},
              headers=key)
    r = harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}, headers=key)
    assert r.status_code == 202


def test_completion_replay_follows_the_first_request(harness):
    """A completion under an Idempotency-Key starts one request; a replay (a client whose
    connection dropped) gets that request again, streamed or not, from its first token."""
    cells = _fleet(harness, 2)
    key = {"Idempotency-Key": "rollout-17", "X-Session-Id": "s17"}
    body = {"prompt_ids": [5, 6, 7], "max_tokens": 6}
    first = harness.complete(body, headers=key)
    pump(cells, until=first)
    out = first.result(timeout=60).json()
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    before = store_dump(harness.db_path)
    again = harness.client.post("/v1/generate", json=body, headers=key)
    assert again.status_code == 200 and again.json() == out  # the same request, the same tokens
    with harness.client.stream("POST", "/v1/generate", json={**body, "stream": True}, headers=key) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert r.headers["x-request-id"] == out["id"]
    assert [t for ln in lines for t in ln.get("token_ids", [])] == out["token_ids"]
    assert store_dump(harness.db_path) == before  # no second request, no second key
    r = _rejected(harness.client, harness.db_path, "POST", "/v1/generate", 409,
                  json={**body, "max_tokens": 7}, headers=key)
    assert r.json()["reason"] == "idempotency_key_reused"
    other = harness.complete(body, headers={**key, "Idempotency-Key": "rollout-18", "X-Session-Id": "s18"})
    pump(cells, until=other)
    assert other.result(timeout=60).json()["id"] != out["id"]  # another key: another request


def test_version_publish_replay_returns_the_first_answer(harness):
    _fleet(harness, 2)
    c, key = harness.client, {"Idempotency-Key": "publish-3"}
    body = {"version": 3, "source": {"host": "127.0.0.1", "port": 1234, "namespace": "versions"}}
    c.put("/v1/trainer/version-host", json={"host": "127.0.0.1", "port": 1234})
    first = c.post("/v1/versions", json=body, headers=key)
    assert first.status_code == 201 and first.json()["receivers"] == ["c0", "c1"]
    before = store_dump(harness.db_path)
    again = c.post("/v1/versions", json=body, headers=key)
    assert again.status_code == 201 and again.json() == first.json()
    assert store_dump(harness.db_path) == before  # no second publish, no second load command
    r = _rejected(c, harness.db_path, "POST", "/v1/versions", 409, json={**body, "version": 4}, headers=key)
    assert r.json()["reason"] == "idempotency_key_reused"
    r = _rejected(c, harness.db_path, "POST", "/v1/versions", 409, json=body)  # no key: a second publish
    assert r.json()["reason"] == "version_exists"


def test_idempotency_keys_expire_after_their_ttl(harness):
    from scheduler.control import idempotency

    _fleet(harness, 3)
    key = {"Idempotency-Key": "old"}
    first = harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}, headers=key)
    assert first.status_code == 202
    ctl, ttl = harness.ctl, harness.ctl.cfg.idempotency_ttl_s
    assert harness.client.portal.call(lambda: idempotency.expire(ctl.store, ttl, time.time() + ttl - 60)) == 0  # not yet
    assert harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}, headers=key).json() == first.json()
    assert harness.client.portal.call(lambda: idempotency.expire(ctl.store, ttl, time.time() + ttl + 60)) == 1
    r = harness.client.post("/v1/flips", json={"cell": "c1", "to": "training"}, headers=key)
    assert r.status_code == 202 and r.json()["id"] != first.json()["id"]  # the key is free again



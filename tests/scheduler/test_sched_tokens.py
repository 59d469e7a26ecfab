"""Completions, token acceptance at sync, the session store and trajectories."""

from __future__ import annotations

import json

import pytest
from sched_fakes import FakeCell, open_harness, pump, until_held

from scheduler.contract.prefixhash import prefix_digest


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _one_cell(harness, **kw) -> FakeCell:
    c = FakeCell(harness.client, "c1", **kw)
    c.register()
    c.sync()
    return c


def test_completion_tokens_logprobs_versions_and_session(harness):
    c = _one_cell(harness)
    fut = harness.complete({"prompt_ids": [7, 8, 9], "max_tokens": 5, "seed": 3, "temperature": 0.7}, session="s1")
    until_held(c, fut)
    start = c.commands[-1]
    assert start["type"] == "start" and start["epoch"] == 1 and start["session_id"] == "s1"
    assert start["token_ids"] == [7, 8, 9] and start["prompt_len"] == 3 and start["num_generated"] == 0
    assert start["params"]["seed"] == 3 and start["params"]["max_tokens"] == 5
    pump([c], until=fut, tokens=2)
    out = fut.result(timeout=60).json()
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length" and out["session_id"] == "s1"
    assert out["versions"] == [0] * 5 and all(lp < 0 for lp in out["logprobs"])
    sess = harness.client.get("/v1/sessions/s1").json()
    assert sess["token_ids"] == [7, 8, 9] + out["token_ids"]
    assert sess["loss_mask"] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert sess["logprobs"][3:] == out["logprobs"] and sess["logprobs"][:3] == [None] * 3
    assert sess["versions"] == [None] * 3 + [0] * 5
    assert sess["old_logprobs"] == [None] * 8 and sess["provenance"] == [None] * 8

    # next turn: the session buffer is a prefix of the new prompt -> only the diff is appended
    fut = harness.complete({"prompt_ids": sess["token_ids"] + [42], "max_tokens": 2}, session="s1")
    until_held(c, fut)
    # sticky: the cell holds the first turn's context, so the start carries only what is new
    start = c.commands[-1]
    assert start["token_ids"] == [42] and start["prompt_len"] == 9 and start["prefix_len"] == 8
    assert start["prefix_hash"] == prefix_digest(sess["token_ids"])
    assert c.held[start["request_id"]].prompt == sess["token_ids"] + [42]
    pump([c], until=fut)
    sess2 = harness.client.get("/v1/sessions/s1").json()
    assert sess2["token_ids"][:9] == sess["token_ids"] + [42] and len(sess2["token_ids"]) == 11
    assert sess2["segment_starts"] == [0]

    # a rewritten history starts a new segment and is counted
    fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": 1}, session="s1")
    pump([c], until=fut)
    sess3 = harness.client.get("/v1/sessions/s1").json()
    assert sess3["segment_starts"] == [0, 11] and sess3["token_ids"][11:13] == [1, 2]
    assert "cellflip_history_rewrites_total 1.0" in harness.client.get("/metrics").text


def test_streaming_sse_matches_store(harness):
    c = _one_cell(harness)
    fut = harness.pool.submit(lambda: harness.client.post(
        "/v1/generate", json={"prompt_ids": [5], "max_tokens": 4, "stream": True}, headers={"X-Session-Id": "ss"}))
    pump([c], until=fut)
    r = fut.result(timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [t for ch in chunks if "token_ids" in ch for t in ch["token_ids"]]
    assert chunks[-1]["finish_reason"] == "length"
    assert harness.client.get("/v1/sessions/ss").json()["token_ids"] == [5] + ids


def test_token_acceptance_rules(harness):
    c = _one_cell(harness, max_running=2)
    fut = harness.complete({"prompt_ids": [1], "max_tokens": 50}, session="t")
    until_held(c, fut)
    rid = next(iter(c.held))
    rec = lambda i: [100 + i, -0.1 * (i + 1), 0, False]  # noqa: E731
    def send(start, recs, epoch=1):
        c.pending_tokens.append({"request_id": rid, "epoch": epoch, "start": start, "records": recs, "finish_reason": None})
        body = c.sync()
        c.held.setdefault(rid, None)  # keep reporting the request even when rejected
        return body["rejected"]
    assert send(0, [rec(0), rec(1)]) == []
    assert send(0, [rec(0), rec(1)]) == []             # exact duplicate: idempotent
    assert send(1, [rec(1), rec(2)]) == []             # overlap + new suffix
    assert send(2, [rec(2)], epoch=0) == [rid]         # stale epoch
    tokens = harness.client.get("/v1/sessions/t").json()["token_ids"]
    assert tokens == [1, 100, 101, 102]
    assert send(1, [[999, -1.0, 0, False]]) == [rid]   # differs from the stored token: drift
    assert "cellflip_retokenization_drift_total 1.0" in harness.client.get("/metrics").text
    # the owner sent an impossible batch: ownership revoked, request re-placed at epoch 2
    req = harness.ctl.store.owners.get_request(rid)
    assert req.cell_id is None and req.epoch == 2 and req.state == "queued"
    c.held.pop(rid, None)
    harness.tick()
    c.sync()
    restart = c.commands[-1]
    assert restart["type"] == "start" and restart["epoch"] == 2 and restart["num_generated"] == 3
    assert send(4, [rec(4)], epoch=2) == [rid]           # gap: refused, re-placed again
    assert harness.client.get("/v1/sessions/t").json()["token_ids"] == [1, 100, 101, 102]


def test_other_cell_cannot_write_tokens(harness):
    c = _one_cell(harness)
    other = FakeCell(harness.client, "c2")
    other.register(), other.sync()
    fut = harness.complete({"prompt_ids": [3], "max_tokens": 3})
    for _ in range(500):
        c.sync(), other.sync()
        if c.held or other.held:
            break
    rid = next(iter({**c.held, **other.held}))
    owner, intruder = (c, other) if rid in c.held else (other, c)
    intruder.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0, "records": [[1, -1.0, 0, False]], "finish_reason": None})
    assert intruder.sync()["rejected"] == [rid]
    pump([owner], until=fut)
    assert fut.result(timeout=60).json()["finish_reason"] == "length"


def test_finish_session_and_trajectories_cursor(harness):
    c = _one_cell(harness)
    for sid in ("a", "b", "c"):
        fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": 2}, session=sid)
        pump([c], until=fut)
    assert harness.client.post("/v1/sessions/a/finish", json={"reward": 1.0, "group_id": "g"}).status_code == 200
    assert harness.client.post("/v1/sessions/a/finish", json={"reward": 1.0, "group_id": "g"}).status_code == 200
    assert harness.client.post("/v1/sessions/a/finish", json={"reward": 0.0}).status_code == 409
    assert harness.client.post("/v1/sessions/c/finish", json={"reward": 0.5}).status_code == 200
    assert harness.client.post("/v1/sessions/zz/finish", json={"reward": 0.5}).status_code == 404
    page = harness.client.get("/v1/trajectories", params={"limit": 1}).json()
    assert [t["id"] for t in page["trajectories"]] == ["a"] and page["trajectories"][0]["reward"] == 1.0
    page2 = harness.client.get("/v1/trajectories", params={"cursor": page["next_cursor"]}).json()
    assert [t["id"] for t in page2["trajectories"]] == ["c"]
    assert page2["trajectories"][0]["loss_mask"] == [0, 0, 1, 1]
    r = harness.client.post("/v1/generate", json={"prompt_ids": [1]}, headers={"X-Session-Id": "a"})
    assert r.status_code == 409 and r.json()["reason"] == "session_finished"


def test_version_retire_waits_for_old_logprobs(harness):
    c = _one_cell(harness)
    assert harness.client.post("/v1/versions", json={"version": 0}).status_code == 201
    harness.tick()
    fut = harness.complete({"prompt_ids": [1], "max_tokens": 3}, session="v")
    pump([c], until=fut)
    assert harness.client.post("/v1/versions", json={"version": 1}).status_code == 201
    assert harness.client.post("/v1/versions", json={"version": 1}).status_code == 409
    c.version = 1
    c.sync()
    harness.tick()
    states = {v["version"]: v["state"] for v in harness.client.get("/v1/versions").json()["versions"]}
    assert states == {0: "retiring", 1: "active"}
    r = harness.client.delete("/v1/versions/0")
    assert r.status_code == 409 and r.json()["reason"] == "unscored_tokens"
    assert harness.client.delete("/v1/versions/1").json()["reason"] == "illegal_transition"
    c.events.append({"type": "scored", "session_id": "v", "start": 0, "old_logprobs": [None, -0.2, -0.3, -0.4]})
    c.events.append({"type": "broadcast", "version": 1, "seconds": 0.3})
    c.sync()
    sess = harness.client.get("/v1/sessions/v").json()
    assert sess["old_logprobs"] == [None, -0.2, -0.3, -0.4] and sess["provenance"] == [None, "exact", "exact", "exact"]
    r = harness.client.delete("/v1/versions/0")
    assert r.status_code == 200 and r.json()["state"] == "retired" and r.json()["tokens_scored"] == 3
    assert harness.client.delete("/v1/versions/7").status_code == 404


def test_non_finite_logprob_quarantines_the_cell_and_the_request_moves_on(harness):
    """No honest engine reports a log-prob of -inf for a token it sampled: nothing of the sync
    is stored, the cell is quarantined (fenced, its id refused until an admin readmits it), and
    its request re-prefills on another cell."""
    c = _one_cell(harness)
    fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": 3}, session="nf")
    until_held(c, fut)
    rid = c.commands[-1]["request_id"]
    raw = json.dumps({"incarnation": c.incarnation, "summary": c.summary(), "events": [], "wait_s": 0.0,
                      "tokens": [{"request_id": rid, "epoch": 1, "start": 0,
                                  "records": [[5, float("-inf"), 0, False]], "finish_reason": "length"}]})
    r = harness.client.post(f"/internal/v1/cells/{c.cell_id}/sync", content=raw,
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 409 and r.json()["reason"] == "fenced", r.text
    cell = harness.client.get(f"/v1/cells/{c.cell_id}").json()
    assert cell["state"] == "down" and cell["trust"] == "quarantined"
    req = harness.ctl.store.owners.get_request(rid)
    assert req.num_generated == 0 and req.epoch == 2  # nothing stored; re-placed at a new epoch
    assert harness.client.get("/v1/sessions/nf").json()["logprobs"] == [None, None]
    again = FakeCell(harness.client, c.cell_id, headers=harness.auth("cell"))
    assert again.register(expect=409)["reason"] == "quarantined"  # a new process under that id: refused
    other = FakeCell(harness.client, "c-ok")
    other.register(), other.sync()
    harness.tick()
    pump([other], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 3

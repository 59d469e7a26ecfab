"""The log-prob service's scheduler side: scoring tasks to holders of a version, version-
filtered writes, `missing` where exact scoring became impossible, drops after the final pass,
and a flip to training that waits for the final pass of what only its cell holds."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, keep_alive, open_harness, pump


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _cell(harness, cid="c1", **kw) -> FakeCell:
    c = FakeCell(harness.client, cid, **kw)
    c.register()
    c.sync()
    return c


def _run(harness, c, session, n=4, prompt=(5, 6, 7)):
    fut = harness.complete({"prompt_ids": list(prompt), "max_tokens": n, "temperature": 0.5}, session=session)
    pump([c], until=fut)
    return fut.result(timeout=60).json()


def _scores(c):
    return [x for x in c.commands if x["type"] == "score"]


def _answer(c, task, values_by_idx):
    c.events.append({"type": "scored", "session_id": task["session_id"], "start": task["start"],
                     "old_logprobs": [values_by_idx[i] for i in range(task["start"], task["end"])],
                     "version": task["version"], "task_id": task["task_id"], "seconds": 0.01})
    c.sync()


def test_finished_request_is_scored_by_a_holder_with_the_right_context(harness):
    c = _cell(harness)
    out = _run(harness, c, "s")
    harness.tick(), c.sync()
    (task,) = _scores(c)
    assert (task["version"], task["context_start"], task["start"], task["end"]) == (0, 0, 3, 7)
    assert task["token_ids"] == [5, 6, 7] + out["token_ids"] and task["temperature"] == 0.5
    harness.tick(), c.sync()
    assert len(_scores(c)) == 1  # one task per range while it is outstanding
    _answer(c, task, {i: -0.1 * i for i in range(3, 7)})
    sess = harness.client.get("/v1/sessions/s").json()
    assert sess["old_logprobs"][3:] == [-0.1 * i for i in range(3, 7)] and set(sess["provenance"][3:]) == {"exact"}
    assert harness.client.get("/v1/versions").json()["versions"] == []  # version 0 was never published


def test_a_scored_event_writes_only_tokens_of_its_version(harness):
    c = _cell(harness)
    _run(harness, c, "s", n=2)
    assert harness.client.post("/v1/versions", json={"version": 1}).status_code == 201  # recorded, no source
    c.version = 1  # the next turn samples under version 1
    _run(harness, c, "s", n=2, prompt=(8,))
    sess = harness.client.get("/v1/sessions/s").json()
    assert sess["versions"] == [None] * 3 + [0, 0] + [None] + [1, 1]
    c.events.append({"type": "scored", "session_id": "s", "start": 3, "old_logprobs": [-1.0] * 5, "version": 1})
    c.sync()
    sess = harness.client.get("/v1/sessions/s").json()
    assert sess["old_logprobs"] == [None] * 6 + [-1.0, -1.0]  # version-0 tokens untouched


def test_no_holder_and_no_source_becomes_missing_after_the_grace(harness):
    c = _cell(harness)
    _run(harness, c, "s")
    c.version, c.versions_held = 1, [1]  # version 0 is gone from every cell; no trainer copy
    c.sync()
    harness.tick()
    sess = harness.client.get("/v1/sessions/s").json()
    assert set(sess["provenance"][3:]) == {None}  # a restarted scheduler waits for reports
    keep_alive(harness, [c], 61.0)
    harness.tick()
    sess = harness.client.get("/v1/sessions/s").json()
    assert set(sess["provenance"][3:]) == {"missing"} and set(sess["old_logprobs"][3:]) == {None}
    metrics = harness.client.get("/metrics").text
    assert "cellflip_logprob_missing_tokens_total 4.0" in metrics


def test_version_dropped_only_after_its_tokens_are_scored(harness):
    c = _cell(harness)
    _run(harness, c, "s")
    c.version, c.versions_held = 1, [0, 1]
    c.sync()
    harness.tick(), c.sync()
    assert not [x for x in c.commands if x["type"] == "drop_version"]
    (task,) = _scores(c)
    _answer(c, task, {i: -0.5 for i in range(3, 7)})
    harness.tick(), c.sync()
    drops = [x for x in c.commands if x["type"] == "drop_version"]
    assert [d["version"] for d in drops] == [0]


def test_flip_to_training_waits_for_the_final_pass_of_a_sole_holder(harness):
    c1, c2 = _cell(harness, "c1"), _cell(harness, "c2")
    c2.version, c2.versions_held = 1, [1]
    c2.sync()
    fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": 3}, session="s")
    pump([c1, c2], until=fut)
    c1.version, c1.versions_held = 1, [0, 1]  # c1 sampled under 0 and alone still holds it
    c1.sync()
    r = harness.client.post("/v1/flips", json={"cell": "c1", "to": "training"})
    assert r.status_code in (200, 201, 202), r.text
    for _ in range(3):
        harness.tick(), c1.sync(), c2.sync()
    assert c1.role == "rollout" and harness.client.get("/v1/cells/c1").json()["state"] == "draining"
    task = _scores(c1)[0]
    _answer(c1, task, {i: -0.3 for i in range(task["start"], task["end"])})
    for _ in range(3):
        harness.tick(), c1.sync(), c2.sync()
    assert c1.role == "training"


def test_no_holder_fetches_from_the_trainer_for_scoring_and_missing_if_that_fails(harness):
    c = _cell(harness)
    src = {"host": "127.0.0.1", "port": 29999}
    harness.client.put("/v1/trainer/version-host", json=src)
    assert harness.client.post("/v1/versions", json={"version": 1, "source": src}).status_code == 201
    c.version = 1
    _run(harness, c, "s")
    c.version, c.versions_held = 2, [2]  # version 1 gone from the cell; the trainer still has it
    c.sync()
    harness.tick(), c.sync()
    first, load = [x for x in c.commands if x["type"] == "load_version" and x["version"] == 1]
    assert first["mode"] == "broadcast" and first["activate"] is True  # at publish
    assert load["mode"] == "fetch" and load["activate"] is False and load["source"]["port"] == 29999
    harness.tick(), c.sync()
    assert len([x for x in c.commands if x["type"] == "load_version" and x["version"] == 1]) == 2  # under way
    c.events.append({"type": "broadcast", "version": 1, "seconds": 0.1, "ok": False, "mode": "fetch",
                     "activate": False, "reason": "unavailable: not held"})
    c.sync()
    harness.clock.advance(1.0)
    harness.tick(), c.sync()
    sess = harness.client.get("/v1/sessions/s").json()
    assert set(sess["provenance"][3:]) == {"missing"}


@pytest.fixture
def unprobed(tmp_path):
    """A fleet that trusts cells sending no registration probe (engines that cannot score)."""
    h = Harness(str(tmp_path / "u.sqlite"), trust_unprobed_cells=True)
    yield h
    h.close()


def test_no_fetch_for_scoring_to_a_cell_that_cannot_score_then_missing_after_the_grace(unprobed):
    """Cells whose engine has no scoring copy (SGLang with `publisher_copy`) are never sent a
    version to score; with no other cell, the tokens become `missing` after the grace."""
    harness = unprobed
    c = _cell(harness, scoring=False)
    src = {"host": "127.0.0.1", "port": 29999}
    harness.client.put("/v1/trainer/version-host", json=src)
    assert harness.client.post("/v1/versions", json={"version": 1, "source": src}).status_code == 201
    c.version = 1
    _run(harness, c, "s")
    assert harness.client.post("/v1/versions", json={"version": 2, "source": src}).status_code == 201
    c.version, c.versions_held = 2, []
    c.sync()
    harness.tick(), c.sync()
    sess = harness.client.get("/v1/sessions/s").json()
    assert "missing" not in sess["provenance"]  # the grace: a scoring cell may still come
    keep_alive(harness, [c], harness.ctl.ctx.ver_cfg.task_timeout_s + 1.0)
    harness.tick(), c.sync()
    assert [x["mode"] for x in c.commands if x["type"] == "load_version" and x["version"] == 1] == ["broadcast"]
    assert not _scores(c)
    sess = harness.client.get("/v1/sessions/s").json()
    assert set(sess["provenance"][3:]) == {"missing"}


def test_a_restarted_cell_is_told_to_fetch_the_current_version_at_once(harness):
    c = _cell(harness)
    src = {"host": "127.0.0.1", "port": 29999}
    harness.client.put("/v1/trainer/version-host", json=src)
    assert harness.client.post("/v1/versions", json={"version": 1, "source": src}).status_code == 201
    c.sync()
    assert [x["mode"] for x in c.commands if x["type"] == "load_version"] == ["broadcast"]
    c2 = FakeCell(harness.client, "c1")  # the same cell id, a new process serving version 0
    c2.register()
    c2.sync()
    harness.tick(), c2.sync()
    loads = [x for x in c2.commands if x["type"] == "load_version"]
    assert [(x["version"], x["mode"]) for x in loads] == [(1, "fetch")]

"""A turn costs what is new: the scheduler compares the prompt with the session by length and
running hash, a sticky turn's start carries only the new tokens, and a cell that lost the
prefix gets the whole context."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, flip_holder, hand_over, open_harness, pump, until_held

from scheduler.contract.prefixhash import prefix_digest


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _turn(harness, c, prompt, max_tokens=3):
    fut = harness.complete({"prompt_ids": prompt, "max_tokens": max_tokens}, session="s")
    until_held(c, fut)
    start = c.commands[-1]
    pump([c], until=fut)
    assert fut.result(timeout=60).status_code == 200
    return start, harness.client.get("/v1/sessions/s").json()


def test_sticky_turns_send_the_new_tokens_and_a_lost_prefix_gets_the_whole_context(harness):
    c = FakeCell(harness.client, "c1")
    c.register()
    c.sync()
    first, sess = _turn(harness, c, [5, 6, 7])
    assert first["prefix_hash"] is None and first["token_ids"] == [5, 6, 7]
    second, sess = _turn(harness, c, sess["token_ids"] + [8, 9])
    assert second["token_ids"] == [8, 9] and second["prefix_len"] == 6
    read = harness.ctl.store.context.tokens_read
    third, sess = _turn(harness, c, sess["token_ids"] + [4])
    assert third["token_ids"] == [4] and third["prefix_len"] == 11
    assert harness.ctl.store.context.tokens_read - read == 2 + 3  # the last turn's new tokens, no more

    c.contexts.clear()  # evicted: the delta start is answered with prefix_missing
    fut = harness.complete({"prompt_ids": sess["token_ids"] + [10], "max_tokens": 3}, session="s")
    until_held(c, fut)
    starts = [m for m in c.commands if m["type"] == "start"]
    delta, full = starts[-2], starts[-1]
    assert delta["prefix_hash"] is not None and delta["request_id"] == full["request_id"]
    assert full["prefix_hash"] is None and full["epoch"] == delta["epoch"]
    assert full["token_ids"] == sess["token_ids"] + [10] and full["prompt_len"] == len(sess["token_ids"]) + 1
    pump([c], until=fut)
    out = fut.result(timeout=60).json()
    final = harness.client.get("/v1/sessions/s").json()
    assert final["token_ids"] == sess["token_ids"] + [10] + out["token_ids"] and final["segment_starts"] == [0]
    metrics = harness.client.get("/metrics").text
    assert "cellflip_prefix_missing_total 1.0" in metrics
    assert 'cellflip_request_starts_total{kind="delta"} 3.0' in metrics  # turns 2, 3 and the refused one
    assert 'cellflip_request_starts_total{kind="full"} 1.0' in metrics  # the first turn (the resend is not a start)


def test_a_cell_holding_another_context_gets_the_whole_one(harness):
    c = FakeCell(harness.client, "c1")
    c.register()
    c.sync()
    _, sess = _turn(harness, c, [5, 6, 7])
    c.contexts["s"] = [5, 6, 99] + sess["token_ids"][3:]  # same length, one id off
    wrong = prefix_digest(c.contexts["s"])
    fut = harness.complete({"prompt_ids": sess["token_ids"] + [8], "max_tokens": 2}, session="s")
    pump([c], until=fut)
    starts = [m for m in c.commands if m["type"] == "start"]
    assert starts[-2]["prefix_hash"] == prefix_digest(sess["token_ids"]) != wrong
    assert starts[-1]["token_ids"] == sess["token_ids"] + [8]


def test_the_prompt_is_compared_by_length_and_hash(harness):
    c = FakeCell(harness.client, "c1")
    c.register()
    c.sync()
    _, sess = _turn(harness, c, [5, 6, 7])
    ids = sess["token_ids"]
    _, sess = _turn(harness, c, ids + [8])  # extends: appended, same segment
    assert sess["segment_starts"] == [0] and sess["token_ids"][:len(ids) + 1] == ids + [8]
    changed = list(sess["token_ids"])
    changed[1] += 1  # negative control: one id of the prefix differs
    _, after = _turn(harness, c, changed + [9])
    n = len(sess["token_ids"])
    assert after["segment_starts"] == [0, n] and after["token_ids"][n:n + len(changed) + 1] == changed + [9]
    _, short = _turn(harness, c, changed[:2])  # shorter than the segment: a rewrite too
    assert len(short["segment_starts"]) == 3


def test_a_turn_placed_on_another_cell_gets_the_whole_context(harness):
    first = FakeCell(harness.client, "c1", max_running=1)
    first.register()
    first.sync()
    fut = harness.complete({"prompt_ids": [5, 6, 7], "max_tokens": 3}, session="s")
    pump([first], until=fut)
    sess = harness.client.get("/v1/sessions/s").json()
    busy = harness.complete({"prompt_ids": [1], "max_tokens": 50}, session="busy")  # fills the session's cell
    until_held(first, busy)
    other = FakeCell(harness.client, "c2")
    other.register()
    other.sync()
    fut = harness.complete({"prompt_ids": sess["token_ids"] + [8], "max_tokens": 2}, session="s")
    until_held(other, fut)
    start = other.commands[-1]
    assert start["type"] == "start" and start["session_id"] == "s"
    assert start["prefix_hash"] is None and start["token_ids"] == sess["token_ids"] + [8]
    pump([first, other], until=[fut, busy])


def test_a_turn_after_a_kv_migration_gets_the_whole_context(harness):
    """The destination got the request by a KV copy, with no start: it holds no context to
    extend, so the next turn's start is a whole one (no prefix_missing round trip)."""
    a, b, fut = flip_holder(harness, 6)
    (mid,) = [c["migration_id"] for c in a.commands if c["type"] == "migrate_out"]
    hand_over(a, b, mid)
    pump([b], until=fut)
    sess = harness.client.get("/v1/sessions/m").json()
    fut = harness.complete({"prompt_ids": sess["token_ids"] + [3], "max_tokens": 2}, session="m")
    until_held(b, fut)
    start = b.commands[-1]
    assert start["type"] == "start" and start["prefix_hash"] is None
    assert start["token_ids"] == sess["token_ids"] + [3]
    pump([b], until=fut)
    assert "cellflip_prefix_missing_total 0.0" in harness.client.get("/metrics").text

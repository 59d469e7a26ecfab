"""Register, sync, leases on the scheduler's monotonic clock, fencing and re-placement."""

from __future__ import annotations

import time

import pytest
from sched_fakes import FakeCell, Harness, keep_alive, open_harness, pump, until_held


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def test_register_then_first_sync_makes_rollout(harness):
    c = FakeCell(harness.client, "c1")
    assert c.register() == {"generation": 1, "lease_s": 5.0, "heartbeat_s": 0.5}
    assert harness.client.get("/v1/cells/c1").json()["state"] == "joining"
    c.sync()
    cell = harness.client.get("/v1/cells/c1").json()
    assert cell["state"] == "rollout" and cell["role"] == "rollout" and cell["generation"] == 2
    assert c.register()["generation"] == 2  # same incarnation again: idempotent


def test_unknown_cell_sync_is_404_and_stale_incarnation_409(harness):
    c = FakeCell(harness.client, "c1")
    assert c.sync(expect=404)["reason"] == "not_found"
    c.register()
    c.incarnation = "other"
    assert c.sync(expect=409)["reason"] == "stale_incarnation"


def test_lease_expiry_fences_and_zombie_gets_409(harness):
    a, b = FakeCell(harness.client, "a"), FakeCell(harness.client, "b")
    for c in (a, b):
        c.register()
        c.sync()
    harness.clock.advance(4.0)
    b.sync()
    harness.tick()
    assert harness.client.get("/v1/cells/a").json()["state"] == "rollout"
    harness.clock.advance(1.5)  # a's lease (5 s) is gone, b synced 1.5 s ago
    harness.tick()
    assert harness.client.get("/v1/cells/a").json()["state"] == "down"
    assert harness.client.get("/v1/cells/b").json()["state"] == "rollout"
    assert a.sync(expect=409)["reason"] == "fenced"
    assert a.register(expect=409)  # a fenced incarnation never comes back
    a.incarnation = "fresh"
    assert a.register()["generation"] >= 3
    a.sync()
    assert harness.client.get("/v1/cells/a").json()["state"] == "rollout"
    text = harness.client.get("/metrics").text
    assert 'cellflip_cells_fenced_total{reason="lease"} 1.0' in text


def test_sync_after_expiry_without_tick_is_fenced(harness):
    a = FakeCell(harness.client, "a")
    a.register()
    harness.clock.advance(6.0)
    assert a.sync(expect=409)["reason"] == "fenced"
    assert harness.client.get("/v1/cells/a").json()["state"] == "down"


def test_dead_owner_requests_reprefill_elsewhere_at_next_epoch(harness):
    a, b = FakeCell(harness.client, "a", max_running=1), FakeCell(harness.client, "b", max_running=1)
    a.register(), a.sync()
    fut = harness.complete({"prompt_ids": [1, 2, 3], "max_tokens": 6}, session="s1")
    until_held(a, fut)
    a.step(3)
    a.sync()
    b.register(), b.sync()
    for _ in range(2):  # a goes silent; b keeps its lease
        harness.clock.advance(3.0)
        b.sync()
    harness.tick()
    assert harness.client.get("/v1/cells/a").json()["state"] == "down"
    b.sync()
    start = [cmd for cmd in b.commands if cmd["type"] == "start"][0]
    assert start["epoch"] == 2 and start["num_generated"] == 3 and start["prompt_len"] == 3
    assert start["token_ids"][:3] == [1, 2, 3] and len(start["token_ids"]) == 6
    a.step(1)
    assert a.sync(expect=409)["reason"] == "fenced"  # the zombie's late tokens are refused
    pump([b], until=fut)
    out = fut.result(timeout=60).json()
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    sess = harness.client.get("/v1/sessions/s1").json()
    assert sess["token_ids"] == [1, 2, 3] + out["token_ids"]
    assert sess["loss_mask"] == [0, 0, 0] + [1] * 6


def test_new_incarnation_fences_old_and_replaces_its_requests(harness):
    a, b = FakeCell(harness.client, "a", max_running=1), FakeCell(harness.client, "b", max_running=1)
    a.register(), a.sync()
    fut = harness.complete({"prompt_ids": [4, 5], "max_tokens": 4})
    until_held(a, fut)
    old_inc = a.incarnation
    b.register(), b.sync()
    a.incarnation, a.held = "reborn", {}
    a.register()
    harness.tick()
    b.sync()
    assert any(c["type"] == "start" and c["epoch"] == 2 for c in b.commands)
    pump([a, b], until=fut)
    assert fut.result(timeout=60).status_code == 200
    a.incarnation = old_inc
    assert a.sync(expect=409)["reason"] == "stale_incarnation"


def test_long_poll_holds_until_a_command_is_queued(harness):
    a, b = FakeCell(harness.client, "a"), FakeCell(harness.client, "b")
    for c in (a, b):
        c.register(), c.sync()
    t0 = time.monotonic()
    a.sync(wait_s=0.2)  # nothing to send: held about wait_s
    assert time.monotonic() - t0 >= 0.15
    t0 = time.monotonic()
    parked = harness.pool.submit(a.sync, 200, 5.0)  # capped at 1 s
    time.sleep(0.05)
    assert harness.client.post("/v1/flips", json={"cell": "a", "to": "training"}).status_code == 202
    harness.tick()  # a holds nothing: set_role training is queued at once
    body = parked.result(timeout=5)
    assert time.monotonic() - t0 < 0.9
    assert [c["type"] for c in body["commands"]] == ["set_role"] and body["commands"][0]["role"] == "training"


def test_reregister_after_expiry_is_fenced(harness):
    a = FakeCell(harness.client, "a")
    a.register(), a.sync()
    harness.clock.advance(6.0)
    assert a.register(expect=409)["reason"] == "fenced"
    assert harness.client.get("/v1/cells/a").json()["state"] == "down"


def test_request_held_but_not_decoded_is_replaced_elsewhere(tmp_path):
    """A cell reports a request but commits no token of it for stall_timeout_s: the request is
    taken back (epoch + 1), re-placed on another cell with the tokens stored so far, and the
    stalled cell is told to drop it; until then nothing moves."""
    h = Harness(str(tmp_path / "sched.sqlite"), stall_timeout_s=10.0)
    try:
        a, b = FakeCell(h.client, "a", max_running=1), FakeCell(h.client, "b", max_running=1)
        a.register(), a.sync()
        fut = h.complete({"prompt_ids": [1, 2, 3], "max_tokens": 6}, session="s1")
        until_held(a, fut)
        b.register(), b.sync()
        a.step(2)
        a.sync()
        for _ in range(4):  # a keeps reporting it (and its lease) but decodes nothing more
            keep_alive(h, [a, b], 2.0)
            h.tick()
        assert not [c for c in b.commands if c["type"] == "start"]  # 8 s < 10 s: still a's
        keep_alive(h, [a, b], 3.0)
        h.tick()
        a.sync(), b.sync()
        assert [c["type"] for c in a.commands if c.get("request_id") == list(b.held)[0]][-1] == "abort"
        start = [c for c in b.commands if c["type"] == "start"][0]
        assert start["epoch"] == 2 and start["num_generated"] == 2 and not a.held
        pump([b], until=fut)
        out = fut.result(timeout=60).json()
        assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
        assert 'cellflip_requests_stalled_total{cell="a"} 1.0' in h.client.get("/metrics").text
    finally:
        h.close()


def test_a_dead_cells_requests_wait_and_are_placed_oldest_first_as_room_appears(harness):
    """Re-queued requests are placed in one pass, oldest first, up to the first that finds no
    room; the rest wait for the next cell with room."""
    a, b = FakeCell(harness.client, "a", max_running=2), FakeCell(harness.client, "b", max_running=2)
    for c in (a, b):
        c.register(), c.sync()
    futs = [harness.complete({"prompt_ids": [i, 7], "max_tokens": 30}, session=f"q{i}") for i in range(4)]
    for _ in range(500):
        for c in (a, b):
            c.sync()
        if len(a.held) + len(b.held) == 4:
            break
        time.sleep(0.01)
    assert len(a.held) == len(b.held) == 2
    for _ in range(3):  # a goes silent: fenced, its two requests wait (b is full)
        harness.clock.advance(2.0)
        b.sync()
        harness.tick()
    owners = harness.ctl.store.owners
    queued = [r.id for r in owners.requests_in(("queued", "suspended"))]
    assert harness.client.get("/v1/cells/a").json()["state"] == "down" and len(queued) == 2
    c = FakeCell(harness.client, "c", max_running=1)
    c.register(), c.sync()
    harness.tick()
    c.sync()
    assert list(c.held) == queued[:1]  # the oldest, alone: c has one slot
    assert [r.id for r in owners.requests_in(("queued", "suspended"))] == queued[1:]
    pump([b, c], harness=harness, until=futs)

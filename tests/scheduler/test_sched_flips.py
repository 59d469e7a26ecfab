"""Flip lifecycle: rollout -> draining -> training -> loading -> rollout, with fake cells."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, hand_over, keep_alive, open_harness, pump, until_held


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _fleet(harness, n: int = 3, **kw) -> list[FakeCell]:
    cells = [FakeCell(harness.client, f"c{i}", **kw) for i in range(n)]
    for c in cells:
        c.register()
        c.sync()
    return cells


def _flip(harness, **body):
    return harness.client.post("/v1/flips", json=body)


def _state(harness, flip_id: str) -> dict:
    return harness.client.get(f"/v1/flips/{flip_id}").json()


def test_flip_to_training_and_back_with_live_migration(harness):
    c0, c1, c2 = _fleet(harness)
    futs = [harness.complete({"prompt_ids": [i, i + 1], "max_tokens": 10}, session=f"s{i}") for i in range(3)]
    pump([c0, c1, c2], rounds=3)
    held = sum(len(c.held) for c in (c0, c1, c2))
    assert held == 3
    gen = harness.client.get("/v1/cells/c0").json()["generation"]
    r = _flip(harness, cell="c0", to="training", expected_generation=gen)
    assert r.status_code == 202 and r.json()["state"] == "pending"
    fid = r.json()["id"]
    harness.tick()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "draining"
    for c in (c0, c1, c2):
        c.sync()
    for mid in list(c0.migrations_out):
        dst = next(c for c in (c1, c2) if any(x.get("migration_id") == mid for x in c.commands))
        hand_over(c0, dst, mid)
    assert not c0.held
    harness.tick()
    c0.sync()
    assert c0.role == "training"  # got set_role
    harness.tick()  # c0's previous summary still said rollout
    c0.sync()
    harness.tick()
    f = _state(harness, fid)
    assert f["state"] == "done" and f["migrated"] >= 1 and f["suspended"] == 0 and f["duration_s"] >= 0
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"
    pump([c0, c1, c2], rounds=400, harness=harness, until=futs)
    for fut in futs:
        assert len(fut.result(timeout=60).json()["token_ids"]) == 10

    r = _flip(harness, cell="c0", to="rollout")
    assert r.status_code == 202
    harness.tick()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "loading"
    c0.sync()
    assert c0.role == "rollout"
    c0.sync()
    harness.tick()
    assert _state(harness, r.json()["id"])["state"] == "done"
    assert harness.client.get("/v1/cells/c0").json()["state"] == "rollout"
    text = harness.client.get("/metrics").text
    assert 'cellflip_flips_total{outcome="done"} 2.0' in text and "cellflip_flip_duration_seconds_count 2.0" in text


def test_flip_guards_and_idempotency(harness):
    c0, c1 = _fleet(harness, 2)
    assert _flip(harness, cell="nope", to="training").status_code == 404
    stale = _flip(harness, cell="c0", to="training", expected_generation=0)
    assert stale.status_code == 409 and stale.json()["reason"] == "stale_generation"
    bad = _flip(harness, cell="c0", to="rollout")
    assert bad.status_code == 409 and bad.json()["reason"] == "illegal_transition"
    key = {"Idempotency-Key": "k1"}
    first = harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}, headers=key)
    again = harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}, headers=key)
    assert first.status_code == again.status_code == 202 and first.json() == again.json()
    other = harness.client.post("/v1/flips", json={"cell": "c1", "to": "training"}, headers=key)
    assert other.status_code == 409 and other.json()["reason"] == "idempotency_key_reused"
    busy = _flip(harness, cell="c0", to="training")
    assert busy.status_code == 409 and busy.json()["reason"] == "flip_in_progress"
    floor = _flip(harness, cell="c1", to="training")
    assert floor.status_code == 409 and floor.json()["reason"] == "min_rollout_cells"
    many = _flip(harness, count=2, to="training")
    assert many.status_code == 409
    assert len(harness.client.get("/v1/flips").json()["flips"]) == 1
    assert harness.client.get("/v1/flips/nope").status_code == 404


def test_count_flip_drains_idle_cell_quickly(harness):
    cells = _fleet(harness, 3)
    r = _flip(harness, count=2, to="training")
    assert r.status_code == 202 and len(r.json()["flips"]) == 2
    for _ in range(3):
        harness.tick()
        for c in cells:
            c.sync()
    states = sorted(harness.client.get(f"/v1/cells/{c.cell_id}").json()["state"] for c in cells)
    assert states == ["rollout", "training", "training"]


def test_count_flips_in_a_row_pick_cells_without_a_flip_under_way(harness):
    """Two `count` flips before the loop runs: the second picks another cell (the first cell's
    flip is only pending, its state still rollout), and the floor still holds."""
    _fleet(harness, 3)
    first, second = _flip(harness, count=1, to="training"), _flip(harness, count=1, to="training")
    assert first.status_code == second.status_code == 202
    assert first.json()["flips"][0]["cell"] != second.json()["flips"][0]["cell"]
    third = _flip(harness, count=1, to="training")  # one rollout cell would be left: refused
    assert third.status_code == 409 and third.json()["reason"] == "no_cells"


def _full_fleet_at_deadline(harness):
    """c0 holds a request and drains to training while c1, the only other cell, is full;
    the drain deadline passes. Returns (c0, c1, future, flip id)."""
    c0 = _fleet(harness, 1, max_running=2)[0]
    fut = harness.complete({"prompt_ids": [9], "max_tokens": 6}, session="d")
    until_held(c0, fut)
    c0.step(2), c0.sync()
    c1 = FakeCell(harness.client, "c1", max_running=1)
    c1.register(), c1.sync()
    blocker = harness.complete({"prompt_ids": [8], "max_tokens": 50}, session="blk")
    until_held(c1, blocker)  # c1 is full: nowhere to migrate
    fid = _flip(harness, cell="c0", to="training").json()["id"]
    harness.tick()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "draining"
    keep_alive(harness, [c0, c1], 31.0)
    harness.tick()
    c0.sync()
    return c0, c1, fut, fid


def _free(harness, c1):
    c1.held.clear()  # free c1 (its request finishes)
    c1.pending_tokens.append({"request_id": next(iter(harness.ctl.store.owners.requests_on("c1"))).id, "epoch": 1,
                              "start": 0, "records": [[1, -1.0, 0, False]], "finish_reason": "stop"})
    c1.sync()
    harness.tick()


def test_drain_deadline_parks_the_kv_then_moves_it_out_when_room_returns(harness):
    c0, c1, fut, fid = _full_fleet_at_deadline(harness)
    cmd = next(x for x in c0.commands if x["type"] == "suspend")
    rid = cmd["request_id"]
    assert cmd["park"] is True and c0.held[rid].parked  # the KV stays on c0, in host memory
    req = harness.ctl.store.owners.get_request(rid)
    assert (req.state, req.cell_id, req.epoch) == ("parked", "c0", 1)
    assert _state(harness, fid)["suspended"] == 1
    harness.check()
    # the flip completes with the parked request still on the (now training) cell
    for _ in range(5):
        harness.tick(), c0.sync()
    assert _state(harness, fid)["state"] == "done" and c0.role == "training"
    assert c0.held[rid].parked
    _free(harness, c1)
    c0.sync(), c1.sync()
    mid = next(m for m, x in c0.migrations_out.items() if x["request_id"] == rid)
    assert any(x["type"] == "migrate_in" and x["migration_id"] == mid for x in c1.commands)
    assert harness.ctl.store.owners.get_request(rid).state == "migrating"
    assert hand_over(c0, c1, mid) == 2  # KV migration out of the parked copy: no re-prefill
    assert not any(x["type"] == "start" and x["request_id"] == rid for x in c1.commands)
    pump([c0, c1], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6


def test_aborted_move_out_of_a_parked_copy_leaves_it_parked(harness):
    c0, c1, fut, fid = _full_fleet_at_deadline(harness)
    rid = next(x for x in c0.commands if x["type"] == "suspend")["request_id"]
    _free(harness, c1)
    c0.sync()
    mid = next(m for m, x in c0.migrations_out.items() if x["request_id"] == rid)
    assert c1.abort_migration(mid, "no blocks after all").status_code == 200
    req = harness.ctl.store.owners.get_request(rid)
    assert (req.state, req.cell_id, req.epoch) == ("parked", "c0", 1)
    harness.check()
    c0.migrations_out.clear()
    harness.tick(), c0.sync(), c1.sync()  # tried again on the next tick
    mid = next(m for m, x in c0.migrations_out.items() if x["request_id"] == rid)
    hand_over(c0, c1, mid)
    pump([c0, c1], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6


def test_parked_copy_lost_with_its_cell_is_re_prefilled(harness):
    c0, c1, fut, fid = _full_fleet_at_deadline(harness)
    rid = next(x for x in c0.commands if x["type"] == "suspend")["request_id"]
    _free(harness, c1)
    keep_alive(harness, [c1], 6.0)  # c0 goes silent past its lease: fenced, the copy is gone
    harness.tick(), c1.sync()
    req = harness.ctl.store.owners.get_request(rid)
    assert req.cell_id == "c1" and req.epoch == 2
    assert any(x["type"] == "start" and x["request_id"] == rid and x["num_generated"] == 2 for x in c1.commands)
    pump([c1], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6


def test_drain_deadline_without_parking_suspends_then_resumes_by_re_prefill(tmp_path):
    harness = Harness(str(tmp_path / "s.sqlite"), migration={"park_on_deadline": False})
    try:
        c0, c1, fut, fid = _full_fleet_at_deadline(harness)
        assert not c0.held and any(x["type"] == "suspend" for x in c0.commands)
        rid = next(x["request_id"] for x in c0.commands if x["type"] == "suspend")
        req = harness.ctl.store.owners.get_request(rid)
        assert req.state == "suspended" and req.epoch == 2
        assert _state(harness, fid)["suspended"] == 1
        _free(harness, c1)
        c1.sync()
        assert any(x["type"] == "start" and x["request_id"] == rid and x["num_generated"] == 2 for x in c1.commands)
        pump([c0, c1], until=fut, harness=harness)
        assert len(fut.result(timeout=60).json()["token_ids"]) == 6
    finally:
        harness.close()


def test_no_kv_export_moves_by_reprefill(harness):
    c0, c1 = _fleet(harness, 2, kv_export=False)
    fut = harness.complete({"prompt_ids": [3, 4], "max_tokens": 6}, session="r")
    for _ in range(500):
        c0.sync(), c1.sync()
        if c0.held or c1.held:
            break
    src = c0 if c0.held else c1
    dst = c1 if src is c0 else c0
    src.step(2), src.sync()
    fid = _flip(harness, cell=src.cell_id, to="training").json()["id"]
    harness.tick()
    src.sync(), dst.sync()
    assert any(x["type"] == "abort" for x in src.commands)
    start = [x for x in dst.commands if x["type"] == "start"][-1]
    assert start["epoch"] == 2 and start["num_generated"] >= 1
    assert _state(harness, fid)["recomputed"] == 1
    pump([src, dst], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6
    assert 'cellflip_migrations_total{outcome="committed",path="reprefill"} 1.0' in harness.client.get("/metrics").text


def _flip_owner_of_one_request(harness, cells: list[FakeCell]) -> tuple[FakeCell, FakeCell, str, object]:
    """Start one request, let its owner sample 2 tokens, flip the owner to training; returns
    (source, destination, flip id, the completion's future) once both cells saw the move."""
    fut = harness.complete({"prompt_ids": [3, 4], "max_tokens": 6}, session="s")
    for _ in range(500):
        for c in cells:
            c.sync()
        if any(c.held for c in cells):
            break
    src = next(c for c in cells if c.held)
    src.step(2), src.sync()
    fid = _flip(harness, cell=src.cell_id, to="training").json()["id"]
    harness.tick()
    for c in cells:
        c.sync()
    dst = next(c for c in cells if c is not src and any(x["type"] == "start" for x in c.commands))
    return src, dst, fid, fut


def test_shared_kv_store_moves_by_kv_store_path(harness):
    cells = _fleet(harness, 2, kv_export=False, kv_store="hicache:abc")
    src, dst, fid, fut = _flip_owner_of_one_request(harness, cells)
    assert any(x["type"] == "abort" for x in src.commands)
    start = [x for x in dst.commands if x["type"] == "start"][-1]
    assert start["path"] == "kv_store" and start["epoch"] == 2 and start["num_generated"] >= 1
    flip = _state(harness, fid)
    assert (flip["kv_store"], flip["recomputed"], flip["migrated"]) == (1, 0, 0)
    pump([src, dst], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6
    text = harness.client.get("/metrics").text
    assert 'cellflip_migrations_total{outcome="committed",path="kv_store"} 1.0' in text
    assert 'cellflip_migrations_total{outcome="committed",path="reprefill"} 0.0' in text


def test_different_kv_stores_or_versions_fall_back_to_reprefill(harness):
    c0 = FakeCell(harness.client, "c0", kv_export=False, kv_store="hicache:abc")
    c1 = FakeCell(harness.client, "c1", kv_export=False, kv_store="hicache:other")
    for c in (c0, c1):
        c.register(), c.sync()
    src, dst, fid, fut = _flip_owner_of_one_request(harness, [c0, c1])
    start = [x for x in dst.commands if x["type"] == "start"][-1]
    assert start["path"] == "reprefill"
    assert (_state(harness, fid)["kv_store"], _state(harness, fid)["recomputed"]) == (0, 1)
    pump([src, dst], until=fut, harness=harness)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 6


def test_kv_store_path_needs_the_same_version(harness):
    c0 = FakeCell(harness.client, "c0", kv_export=False, kv_store="s", version=1)
    c1 = FakeCell(harness.client, "c1", kv_export=False, kv_store="s", version=2)
    c2 = FakeCell(harness.client, "c2", kv_export=True, kv_store="s", version=1)
    c3 = FakeCell(harness.client, "c3", kv_export=True, kv_store=None, version=1)
    for c in (c0, c1, c2, c3):
        c.register(), c.sync()
    ctl = harness.ctl
    row = {c.cell_id: ctl.store.fleet.get_cell(c.cell_id) for c in (c0, c1, c2, c3)}
    assert ctl.migrations.path_for(row["c0"], row["c1"]) == "reprefill"  # KV of v1 is no use to v2
    assert ctl.migrations.path_for(row["c0"], row["c2"]) == "kv_store"
    assert ctl.migrations.path_for(row["c2"], row["c3"]) == "kv"
    assert ctl.migrations.path_for(row["c2"], row["c3"], hint="reprefill") == "reprefill"
    assert ctl.migrations.path_for(row["c0"], row["c2"], hint="kv") == "kv_store"  # the best both support
    assert ctl.migrations.path_for(row["c2"], row["c0"], hint="kv_store") == "kv_store"


def test_role_failure_rolls_back(harness):
    c0, c1 = _fleet(harness, 2)
    _flip(harness, cell="c0", to="training")
    harness.tick(), c0.sync(), c0.sync(), harness.tick()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"
    fid = _flip(harness, cell="c0", to="rollout").json()["id"]
    harness.tick()
    c0.role = "training"
    c0.events.append({"type": "role_failed", "flip_id": fid, "reason": "checksum mismatch"})
    c0.sync()
    f = _state(harness, fid)
    assert f["state"] == "rolled_back" and f["reason"] == "checksum mismatch"
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"


def test_rolled_back_drain_restates_the_rollout_role(harness):
    """The drain's set_role reached the cell, then the flip rolled back (rollout capacity fell
    under the minimum): the store keeps the cell in rollout, so the scheduler tells the cell
    its role again, and a request placed there is decoded."""
    c0, c1 = _fleet(harness, 2)
    fid = _flip(harness, cell="c0", to="training").json()["id"]
    harness.tick()  # c0 holds nothing: the drain sends set_role training at once
    c0.sync(), c1.sync()
    assert c0.role == "training" and _state(harness, fid)["state"] == "draining"
    harness.clock.advance(3.0)
    c0.sync()
    harness.clock.advance(3.0)  # c1 silent past its lease: fenced, capacity under the minimum
    c0.sync()
    harness.tick()
    assert _state(harness, fid)["state"] == "rolled_back"
    assert harness.client.get("/v1/cells/c0").json()["state"] == "rollout"
    c0.sync()  # reports training: the store says rollout
    harness.tick()
    c0.sync()
    assert c0.role == "rollout"
    assert [c["role"] for c in c0.commands if c["type"] == "set_role"] == ["training", "rollout"]
    harness.tick()
    c0.sync()
    assert [c["role"] for c in c0.commands if c["type"] == "set_role"] == ["training", "rollout"]  # once per lease
    fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": 4}, session="s")
    pump([c0], until=fut)
    assert len(fut.result(timeout=10).json()["token_ids"]) == 4

"""The fleet tally: rollout slots and role-seconds kept by change agree with a full recount,
and the per-cell families appear at scrape time."""

from __future__ import annotations

import re
import time

import pytest
from sched_fakes import FakeCell, hand_over, keep_alive, open_harness, pump

from scheduler.control.tally import FleetTally


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def recount(ctl) -> tuple[int, int]:
    """(offered, occupied) rollout slots by a full walk of the store and registry."""
    owned = ctl.store.owners.live_counts()
    offered = occupied = 0
    for c in ctl.store.fleet.list_cells():
        if c.state == "rollout" and c.id in ctl.ctx.registry.live:
            offered += c.max_running
            occupied += min(c.max_running, owned.get(c.id, 0))
    return offered, occupied


def role_seconds(harness) -> dict[tuple[str, str], float]:
    text = harness.client.get("/metrics").text
    pat = r'cellflip_cell_role_seconds_total\{cell="([^"]+)",state="([^"]+)"\} (\S+)'
    return {(c, s): float(v) for c, s, v in re.findall(pat, text)}


def slots(harness) -> tuple[int, int]:
    tally = harness.ctl.loop.tally
    return tally.offered, tally.occupied


def test_slots_follow_requests_flips_and_fencing(harness):
    cells = [FakeCell(harness.client, f"c{i}", max_running=2) for i in range(3)]
    for c in cells:
        c.register(), c.sync()
    harness.tick()
    assert slots(harness) == recount(harness.ctl) == (6, 0)
    futs = [harness.complete({"prompt_ids": [i, i + 1], "max_tokens": 8}, session=f"s{i}") for i in range(4)]
    for _ in range(500):  # until every completion is placed (bounded)
        for c in cells:
            c.sync()
        if sum(len(c.held) for c in cells) == 4:
            break
        time.sleep(0.01)
    harness.tick()
    assert sum(len(c.held) for c in cells) == 4
    assert slots(harness) == recount(harness.ctl) == (6, 4)
    # c0 flips to training: its requests move, its slots leave the offer
    c0, c1, c2 = cells
    assert harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).status_code == 202
    harness.tick()
    for c in cells:
        c.sync()
    for mid in list(c0.migrations_out):
        dst = next(c for c in (c1, c2) if any(x.get("migration_id") == mid for x in c.commands))
        hand_over(c0, dst, mid)
    for _ in range(3):
        harness.tick()
        for c in cells:
            c.sync()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"
    harness.tick()
    assert slots(harness) == recount(harness.ctl)
    assert slots(harness)[0] == 4
    # c2 stops syncing: its lease runs out, it is fenced, its slots leave too
    keep_alive(harness, [c0, c1], 6.0)
    harness.tick()
    assert "c2" not in harness.ctl.ctx.registry.live
    assert slots(harness) == recount(harness.ctl)
    assert slots(harness)[0] == 2
    pump([c0, c1], harness=harness, until=futs)  # c2's requests are placed again and finish
    harness.tick()
    assert slots(harness) == recount(harness.ctl) == (2, 0)


def test_role_seconds_count_live_time_in_each_state(harness):
    c0, c1 = FakeCell(harness.client, "c0"), FakeCell(harness.client, "c1")
    for c in (c0, c1):
        c.register(), c.sync()
    harness.tick()
    keep_alive(harness, [c0, c1], 3.0)
    harness.tick()
    got = role_seconds(harness)
    assert got[("c0", "rollout")] == pytest.approx(3.0) and got[("c1", "rollout")] == pytest.approx(3.0)
    # c1 goes silent: counted until the tick that fences it, then never again
    keep_alive(harness, [c0], 6.0)
    harness.tick()
    assert "c1" not in harness.ctl.ctx.registry.live
    frozen = role_seconds(harness)[("c1", "rollout")]
    assert frozen == pytest.approx(9.0)
    keep_alive(harness, [c0], 4.0)
    harness.tick()
    got = role_seconds(harness)
    assert got[("c1", "rollout")] == frozen and got[("c0", "rollout")] == pytest.approx(13.0)
    # the open interval counts up to the scrape, between ticks too
    harness.clock.advance(0.5)
    assert role_seconds(harness)[("c0", "rollout")] == pytest.approx(13.5)


def test_an_idle_tick_reads_no_cell(harness, monkeypatch):
    cells = [FakeCell(harness.client, f"c{i}") for i in range(3)]
    for c in cells:
        c.register(), c.sync()
    harness.tick()
    fleet = harness.ctl.store.fleet
    reads = []
    real = fleet.planning_rows
    monkeypatch.setattr(fleet, "planning_rows", lambda ids=None: (reads.append(ids), real(ids))[1])
    tally = harness.ctl.loop.tally
    tally.advance(harness.clock())
    assert reads == []  # nothing changed: nothing read
    assert harness.client.post("/v1/flips", json={"cell": "c1", "to": "training"}).status_code == 202
    harness.tick()  # c1 starts draining
    assert harness.client.get("/v1/cells/c1").json()["state"] == "draining"
    harness.tick()  # the tally sees it at the next tick's start
    assert reads and all(ids is not None and set(ids) <= {"c1"} for ids in reads)  # only the cell that changed


def test_after_a_rollback_the_tally_is_rebuilt_whole(harness):
    cells = [FakeCell(harness.client, f"c{i}", max_running=3) for i in range(2)]
    for c in cells:
        c.register(), c.sync()
    harness.tick()
    ctl = harness.ctl
    with pytest.raises(RuntimeError), ctl.txn():
        ctl.store.execute("UPDATE cells SET state='training' WHERE id='c0'")
        raise RuntimeError("undone")
    ctl.loop.tally.advance(harness.clock())
    fresh = FleetTally(ctl.ctx)
    fresh.advance(harness.clock())
    assert slots(harness) == (fresh.offered, fresh.occupied) == recount(ctl) == (6, 0)


def test_rotation_visits_every_live_cell_once_per_round():
    from scheduler.control.notify import Notifier
    from scheduler.control.registry import Registry

    reg = Registry(lambda: 0.0, Notifier())
    for i in range(25):
        reg.admit(f"c{i:02d}", 10.0, seen=True)
    rot = reg.rotation(per_tick=10)
    seen = [rot.next() for _ in range(3)]
    assert all(len(s) == 10 for s in seen)
    assert sorted(set().union(*map(set, seen))) == sorted(reg.live)  # all 25 within one round of 3
    assert seen[0] == [f"c{i:02d}" for i in range(10)] and seen[2][:5] == [f"c{i:02d}" for i in range(20, 25)]
    reg.drop("c12")
    reg.admit("c99", 10.0, seen=True)
    visited = set()
    for _ in range(3):
        visited |= set(rot.next())
    assert visited == set(reg.live) and "c12" not in visited  # gone cells leave, new ones join
    small = reg.rotation(per_tick=100)
    assert small.next() == small.next() == sorted(reg.live)  # a small fleet: all of it every call


def test_expired_leases_match_a_full_walk():
    """The heap of deadlines reports exactly the live cells past their lease, whatever the order
    of admits, renewals, re-registrations and drops."""
    import random

    from scheduler.contract.protocol import Summary
    from scheduler.control.notify import Notifier
    from scheduler.control.registry import Registry

    rng = random.Random(7)
    now = [0.0]
    reg = Registry(lambda: now[0], Notifier())
    for step in range(3000):
        op, cid = rng.random(), f"c{rng.randrange(40)}"
        if op < 0.2:
            reg.admit(cid, rng.uniform(0.5, 5.0), seen=True)
        elif op < 0.6 and cid in reg.live:
            reg.renew(cid, rng.uniform(0.5, 5.0), Summary())
        elif op < 0.7 and cid in reg.live:
            reg.extend(cid, rng.uniform(0.5, 5.0))
        elif op < 0.75:
            reg.drop(cid)
        else:
            now[0] += rng.uniform(0.0, 0.3)
        if step % 7 == 0:
            want = sorted(c for c, e in reg.live.items() if now[0] > e.lease_deadline)
            assert reg.expired() == want, step
            for c in want[: len(want) // 2]:  # the caller fences some of them, not all
                reg.drop(c)

"""The store's kept counters (store/counters.py) and the rows kept between reads (the cell list,
the snapshot's per-cell summaries) equal a full recount; GET /v1/cells pages by id."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.contract.config.scheduler import SchedulerConfig
from scheduler.contract.protocol import Summary
from scheduler.control.controller import Controller
from scheduler.control.snapshot import CellSummaries
from scheduler.store import Store, counters
from scheduler.store.fleet import CellRow, _cell
from scheduler.store.owners import MigrationRow, RequestRow
from tests.scheduler.sched_fakes import Harness
from tests.scheduler.storecheck import fleet


def _agree(store: Store) -> None:
    assert counters.stored(store) == counters.recount(store)


def _script(store: Store) -> None:
    """Requests through every state and owner, token progress, migrations, a rollback."""
    o = store.owners
    for i in range(12):
        with store.tx():
            o.put_request(RequestRow(f"r{i}", f"s{i}", 10 * i, i, 0, {}, f"c{i % 3}", 1,
                                     ("running", "queued", "parked", "migrating")[i % 4]))
    _agree(store)
    for i in range(0, 12, 2):
        o.set_num_generated(f"r{i}", 7 + i)
    q = o.get_request("r1")
    q.state, q.cell_id = "running", "c2"  # queued → running on c2
    o.put_request(q)
    q = o.get_request("r0")
    q.cell_id, q.epoch = "c1", 2  # moved while running
    o.put_request(q)
    for rid, state in (("r4", "finished"), ("r2", "suspended"), ("r3", "failed")):
        q = o.get_request(rid)
        q.state, q.cell_id = state, None if state != "finished" else q.cell_id
        o.put_request(q)
    _agree(store)
    m = MigrationRow("m1", "r7", "c1", "c2", 2, "pending", "kv")
    o.put_migration(m)
    o.put_migration(MigrationRow("m2", "r11", "c2", "c0", 2, "pending", "kv"))
    _agree(store)
    m.state = "committed"
    o.put_migration(m)
    with pytest.raises(RuntimeError), store.tx():  # a rolled-back transaction leaves no trace
        q = o.get_request("r5")
        q.state = "running"
        o.put_request(q)
        o.set_num_generated("r6", 999)
        o.put_migration(MigrationRow("m3", "r9", "c1", "c0", 3, "pending", "kv"))
        raise RuntimeError("undone")
    _agree(store)


def test_counters_equal_a_recount_after_changes_and_a_restart(tmp_path):
    path = tmp_path / "s.sqlite"
    store = Store(path)
    _script(store)
    load, states = counters.stored(store)
    assert load["c0"][2] == 1 and states["running"] >= 3  # the script left something to count
    assert store.owners.live_load() == {c: (v[0], v[1]) for c, v in load.items() if v[0]}
    assert store.owners.count_requests() == states
    store.close()
    again = Store(path)  # a restart on the same store
    assert counters.stored(again) == (load, states)
    _agree(again)
    again.execute("UPDATE cell_load SET live = live + 5")  # counters gone wrong, or an older store:
    again.execute("DELETE FROM request_counts")
    again.close()
    third = Store(path)  # rebuilt from the tables on open
    assert counters.stored(third) == (load, states)
    third.close()


def test_cell_list_kept_between_reads_equals_a_fresh_read(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    fresh = lambda: [_cell(r) for r in store.execute("SELECT * FROM cells ORDER BY id")]  # noqa: E731
    for i in (3, 1, 2):
        store.fleet.put_cell(CellRow(f"c{i}", "x", "rollout", 1, 0, f"h{i}:1", 1, {"a": i}, 8, 0, 4))
    assert store.fleet.list_cells() == fresh()
    row = store.fleet.get_cell("c2")
    row.state, row.generation = "training", 2
    store.fleet.put_cell(row)
    store.execute("UPDATE cells SET kv_blocks_used = 3 WHERE id = 'c1'")
    store.fleet.put_cell(CellRow("c0", "y", "joining", 1, None, "h0:1", 1, {}, 8, 0, 4))
    assert store.fleet.list_cells() == fresh()
    with pytest.raises(RuntimeError), store.tx():
        store.execute("DELETE FROM cells WHERE id = 'c3'")
        assert [c.id for c in store.fleet.list_cells()] == ["c0", "c1", "c2"]  # read inside, then undone
        raise RuntimeError("undone")
    assert store.fleet.list_cells() == fresh()
    store.execute("DELETE FROM cells WHERE id = 'c1'")
    assert store.fleet.list_cells() == fresh()


def test_snapshot_summaries_kept_between_builds_equal_a_fresh_build(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    ctl = Controller(store, SchedulerConfig(db_path=str(tmp_path / "s.sqlite"), min_rollout_cells=1))
    for i in range(3):
        store.fleet.put_cell(CellRow(f"c{i}", "x", "rollout" if i else "training", 1, 0, f"h{i}:1", 1,
                                     {"kv_export": True}, 64, 0, 4, trust="verified"))
        ctl.ctx.registry.admit(f"c{i}", 60.0, seen=True)
    kept = CellSummaries(ctl.ctx)

    def check() -> None:
        got = kept.current(None, set())  # first: it takes what the registry marked
        assert got == CellSummaries(ctl.ctx).current(None, set())  # a fresh one reads every cell

    check()
    _script(store)
    check()
    ctl.ctx.registry.renew("c1", 60.0, Summary(kv_blocks_used=9, kv_blocks_total=64, version=0))
    row = store.fleet.get_cell("c2")
    row.state = "down"
    store.fleet.put_cell(row)
    check()
    ctl.ctx.registry.drop("c1")
    check()
    busy = kept.current(None, {"c0"})
    assert [c.cell_id for c in busy if c.busy] == ["c0"]
    assert dataclasses.replace(busy[0], busy=False) == kept.current(None, set())[0]


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


def test_cell_pages_hold_every_cell_once(harness):
    fleet(harness, 7)
    whole = harness.client.get("/v1/cells").json()
    assert whole["next_cursor"] is None and [c["id"] for c in whole["cells"]] == [f"c{i}" for i in range(7)]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = harness.client.get("/v1/cells", params=params).json()
        seen += [c["id"] for c in page["cells"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"c{i}" for i in range(7)] and pages == 3
    assert [c["id"] for c in harness.client.get("/v1/cells", params={"limit": 7}).json()["cells"]] == seen
    after = harness.client.get("/v1/cells", params={"cursor": "c6"}).json()
    assert after == {"cells": [], "next_cursor": None}
    one = harness.client.get("/v1/cells/c4").json()
    assert one == next(c for c in whole["cells"] if c["id"] == "c4") | {"lease_remaining_s": one["lease_remaining_s"]}


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "-1"}, {"limit": "abc"}, {"limit": "1.5"},
                                    {"limit": ""}, {"limit": "10001"}, {"limit": "9" * 40}, {"cursor": ""},
                                    {"cursor": "x" * 300}, {"cursor": "a\nb"}])
def test_bad_paging_values_are_400(harness, params):
    r = harness.client.get("/v1/cells", params=params)
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == "bad_page"

"""The reconcile tick visits what changed: version catch-up and progress, a rollback's re-read,
the lease heap and the owners' report sweep still reach every cell they must."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, fetches, publish, registered

from scheduler.contract.protocol import Summary
from scheduler.control.notify import Notifier
from scheduler.control.registry import Registry
from scheduler.store import Store


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "t.sqlite"))
    yield h
    h.close()




def test_a_cell_that_lags_without_changing_is_told_again_after_the_load_timeout(harness):
    h = harness
    cells = registered(h, 3, "c")
    publish(h, 1)
    for c in cells[:2]:
        c.version = 1
        c.sync()
    lag = cells[2]
    lag.sync()  # it missed the broadcast and says nothing new from now on
    h.tick()
    lag.sync()
    assert fetches(lag) == []  # told by the broadcast: not again within the load timeout
    timeout = h.ctl.ctx.ver_cfg.load_timeout_s
    for _ in range(2):
        waited = 0.0
        while waited <= timeout:
            h.clock.advance(2.0)
            waited += 2.0
            for c in cells:
                c.sync()  # keep the leases; the lagging cell reports nothing new
            h.tick()
        lag.sync()
    # each time the timeout came due it was told to fetch, once, without a change of its own
    assert fetches(lag) == [1, 1]
    assert fetches(cells[0]) == []  # negative control: a cell serving the target is not told
    lag.version = 1
    lag.sync()
    h.tick()
    assert h.client.get("/v1/versions").json()["versions"][-1]["state"] == "active"


def test_progress_waits_for_every_rollout_cell(harness):
    h = harness
    cells = registered(h, 3, "p")
    publish(h, 1)
    for c in cells[:2]:
        c.version = 1
        c.sync()
    h.tick()
    assert h.client.get("/v1/versions").json()["versions"][-1]["state"] == "broadcasting"
    cells[2].version = 1
    cells[2].sync()
    h.tick()
    assert h.client.get("/v1/versions").json()["versions"][-1]["state"] == "active"


def test_a_rolled_back_write_is_re_read_by_every_reader(tmp_path):
    store = Store(str(tmp_path / "s.sqlite"))
    store.execute("INSERT INTO cells(id, incarnation, state, generation, version, address, store_port, capabilities, "
                  "kv_blocks_total, kv_blocks_used, max_running, history, trust) "
                  "VALUES ('a','i','rollout',1,0,'h:1',1,'{}',8,0,1,'[]','verified')")
    reader = store.changes.reader()
    reader.take()
    seen = None
    with pytest.raises(RuntimeError), store.tx():
        store.execute("UPDATE cells SET state='training' WHERE id='a'")
        assert reader.take() == {"a"}  # read inside the transaction: the uncommitted state
        seen = store.fleet.cell_states({"a"})["a"]
        raise RuntimeError("undone")
    assert seen == "training"
    assert reader.take() == {"a"}  # named again: its reader re-reads what the rollback left
    assert store.fleet.cell_states({"a"})["a"] == "rollout"
    with store.tx():
        store.execute("UPDATE cells SET kv_blocks_used=1 WHERE id='a'")
    assert reader.take() == {"a"}
    assert reader.take() == set()  # negative control: a committed write is named once
    store.close()


def test_the_lease_heap_expires_only_lapsed_leases():
    t = [0.0]
    reg = Registry(lambda: t[0], Notifier())
    for c in ("a", "b"):
        reg.admit(c, 5.0, seen=True)
    for _ in range(20):  # many renewals queue nothing more
        t[0] += 1.0
        reg.renew("a", 5.0, Summary())
    assert len(reg._deadlines) <= 3
    assert reg.expired() == ["b"]  # b lapsed at 5 s; a was renewed every second
    t[0] += 6.0
    assert reg.expired() == ["a", "b"]
    reg.renew("b", 5.0, Summary())
    assert reg.expired() == ["a"]


def test_a_stray_is_found_by_the_count_and_a_swap_by_the_full_sweep(harness):
    h = harness
    c = FakeCell(h.client, "s0")
    c.register()
    c.sync()
    c.held_extra = None
    # a stray: the cell reports a request it does not own (counts differ)
    r = h.client.post(f"/internal/v1/cells/{c.cell_id}/sync", json={
        "incarnation": c.incarnation, "summary": {**c.summary(), "request_ids": ["ghost"], "inflight": 1}})
    assert r.status_code == 200
    h.tick()
    body = h.client.post(f"/internal/v1/cells/{c.cell_id}/sync", json={
        "incarnation": c.incarnation, "summary": {**c.summary(), "request_ids": ["ghost"], "inflight": 1}}).json()
    assert [(x["type"], x["request_id"]) for x in body["commands"]] == [("abort", "ghost")]
    # negative control: reporting nothing, holding nothing: no command
    c.sync()
    h.tick()
    assert not c.sync()["commands"]

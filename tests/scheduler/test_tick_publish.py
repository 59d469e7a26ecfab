"""A publish's tick does not walk the fleet: the cells its broadcast told are looked at again
when their load would time out, and only the others are visited at once. What the cells are told
is what a visit of every cell would tell them. Also: the change readers' hand-over and the
snapshot's busy copies, built without the generic helpers."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from sched_fakes import Harness, fetches, publish, registered

from scheduler.control.snapshot import _busy
from scheduler.planner.types import CellSummary
from scheduler.store import Store


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "t.sqlite"))
    yield h
    h.close()




def _visits(h: Harness) -> list[set[str]]:
    """The cells each new target's first visit walks (recorded around `_first_visit`)."""
    seen: list[set[str]] = []
    versions = h.ctl.versions
    first = versions._first_visit

    def spy(v: int, now: float) -> set[str]:
        out = first(v, now)
        seen.append(set(out))
        return out

    versions._first_visit = spy
    return seen


def test_a_publish_tick_visits_only_the_cells_its_broadcast_did_not_tell(harness):
    h = harness
    cells = registered(h, 4, "c")
    h.tick()
    visits = _visits(h)
    publish(h, 1)
    restarted = cells[3]  # a new process after the broadcast: it never heard of version 1
    restarted.incarnation = uuid.uuid4().hex[:8]
    restarted.register()
    restarted.sync()
    h.tick()
    for c in cells:
        c.sync()
    assert visits == [{"c3"}]  # the told cells are left out of the walk
    assert fetches(restarted) == [1]  # visited at once, as a walk of every cell would
    assert [fetches(c) for c in cells[:3]] == [[], [], []]  # negative control: told, not told again
    waited, timeout = 0.0, h.ctl.ctx.ver_cfg.load_timeout_s
    while waited <= timeout:
        h.clock.advance(2.0)
        waited += 2.0
        for c in cells:
            c.sync()  # keep the leases; the told cells report nothing new
        h.tick()
    for c in cells:
        c.sync()
    # each told cell that still lags is told to fetch once its load timed out, as before
    assert [fetches(c) for c in cells[:3]] == [[1], [1], [1]]


def test_a_later_first_visit_of_the_same_version_walks_every_cell(harness):
    h = harness
    registered(h, 3, "d")
    visits = _visits(h)
    publish(h, 1)
    h.tick()
    h.ctl.versions._caught_up = None  # as if another target came between
    h.tick()
    assert visits == [set(), {"d0", "d1", "d2"}]  # the broadcast's shortcut is used once


def test_change_readers_hand_over_their_own_sets(tmp_path):
    store = Store(str(tmp_path / "s.sqlite"))
    a, b = store.changes.reader(), store.changes.reader()
    assert a.take() == set() and b.take() == set()  # equal (empty) sets: each keeps its own
    store.changes.mark("x")
    got = a.take()
    store.changes.mark("y")
    assert got == {"x"}  # handed over: a later mark does not land in it
    assert a.take() == {"y"}
    assert b.take() == {"x", "y"}  # negative control: the other reader lost nothing
    assert a.take() == set() and b.take() == set()
    store.close()


def test_a_busy_copy_is_the_summary_with_busy_set():
    c = CellSummary("c1", "n1", "training", 7, 3, 8, 100, 200, 4, True, False, 12345, "store-a")
    assert [f.name for f in dataclasses.fields(c)][-3:] == ["busy", "inflight_tokens", "kv_store"]
    assert _busy(c) == dataclasses.replace(c, busy=True)
    assert _busy(c) != c  # negative control
    assert hash(_busy(c)) == hash(dataclasses.replace(c, busy=True))

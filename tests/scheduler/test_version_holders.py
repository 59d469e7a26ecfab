"""The scoring's version holders kept by change (scheduler/control/holders.py): after cells
report other versions held, change state or leave, each version's holders equal a
walk of the whole fleet, and a copy that stops re-reading what changed is caught."""

from __future__ import annotations

import random

import pytest
from sched_fakes import FakeCell, open_harness

from scheduler.control.holders import SCORING_ROLES


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _walk(ctl, version: int) -> list[str]:
    """The holders as a walk of every live cell (what the pass did before)."""
    served = ctl.scoring.served
    served.refresh()
    return sorted(cid for cid, (state, _, _) in served.cells.items()
                  if state in SCORING_ROLES and (s := ctl.ctx.registry.summary(cid)) is not None
                  and version in s.versions_held)


def _changes(harness, cells: list[FakeCell], rng: random.Random):
    """Random changes, yielding after each: versions held, a cell's state, a cell dropped from
    the live registry (at most two)."""
    live = list(cells)
    while True:
        c = rng.choice(live)
        kind = rng.choice(["held", "held", "state", "drop"] if len(live) > len(cells) - 2 else ["held", "state"])
        if kind == "held":
            c.versions_held = rng.sample(range(4), rng.randrange(0, 3))
            c.sync()
        elif kind == "state":
            harness.ctl.ctx.store.execute("UPDATE cells SET state=? WHERE id=?",
                                          (rng.choice(["rollout", "draining", "training"]), c.cell_id))
        else:
            harness.client.portal.call(harness.ctl.ctx.registry.drop, c.cell_id)
            live.remove(c)
        yield


def _cells(harness, n: int) -> list[FakeCell]:
    cells = []
    for k in range(n):
        c = FakeCell(harness.client, f"c{k}")
        c.register()
        c.sync()
        cells.append(c)
    return cells


def test_the_holders_kept_by_change_equal_a_walk_of_the_fleet(harness):
    rng, ctl = random.Random(3), harness.ctl
    cells = _cells(harness, 6)
    seen, changes = set(), _changes(harness, cells, rng)
    for _ in range(60):
        next(changes)
        for v in range(4):
            got = ctl.scoring._holders(v)
            assert got == _walk(ctl, v), v
            seen.add(len(got))
    assert len(seen) > 2, "the holders changed during the run"


def test_a_copy_that_stops_rereading_is_caught(harness, monkeypatch):
    rng, ctl = random.Random(3), harness.ctl
    cells = _cells(harness, 6)
    ctl.scoring._holders(0)
    monkeypatch.setattr(type(ctl.scoring.holders), "_refresh", lambda self: None)
    differed, changes = False, _changes(harness, cells, rng)
    for _ in range(60):
        next(changes)
        differed |= any(ctl.scoring._holders(v) != _walk(ctl, v) for v in range(4))
    assert differed

"""The planner's kept summaries rebuild at most `per_build` cells a build for a change of load or
version alone (a publish's tick: every rollout cell reports the new version at once); the rest
wait their turn, oldest first, and catch up within a few builds. A change of role, presence or
requests in flight is taken at once, whatever the budget."""

from __future__ import annotations

from test_tick_incremental import Fleet, kept_differs

from scheduler.control.snapshot import LOAD_REFRESH_PER_BUILD, CellSummaries


def _versions(ctl) -> dict[str, int]:
    return {c.cell_id: c.version for c in ctl.snapshot().cells}


def test_a_fleet_wide_version_change_is_taken_a_budget_a_build(tmp_path):
    f = Fleet(str(tmp_path / "s.sqlite"), False)
    ctl = f.ctl
    ctl.snapshot()
    ctl.cell_summaries.per_build = 20
    for c in f.ids:  # every cell reports version 1 at once
        f.version[c] = 1
        f.sync(c)
    seen = []
    for _ in range(4):
        seen.append(sum(1 for v in _versions(ctl).values() if v == 1))
    assert seen == [20, 40, 60, 60]  # 60 cells, 20 a build, the oldest first, then all current
    assert kept_differs(ctl) == []  # caught up: what a read from scratch gives
    fresh = CellSummaries(ctl.ctx)
    assert sum(1 for c in fresh.current(None, set()) if c.version == 1) == 60  # no budget on a first read


def test_a_role_change_is_taken_at_once_past_the_budget(tmp_path):
    f = Fleet(str(tmp_path / "s.sqlite"), False)
    ctl = f.ctl
    ctl.snapshot()
    ctl.cell_summaries.per_build = 0  # no load-only change is taken
    for c in f.ids:
        f.version[c] = 1
        f.sync(c)
    flipped = f.ids[10]
    with f.store.tx():
        f.store.execute("UPDATE cells SET state='training' WHERE id=?", (flipped,))
    f.sync(flipped)
    snap = {c.cell_id: c for c in ctl.snapshot().cells}
    assert snap[flipped].role == "training" and snap[flipped].version == 1  # taken whole, at once
    assert sum(1 for c in snap.values() if c.version == 1) == 1  # the others wait
    assert set(ctl.cell_summaries.later) == set(f.ids) - {flipped}
    ctl.cell_summaries.per_build = LOAD_REFRESH_PER_BUILD  # negative control: the default takes all
    assert all(v == 1 for v in _versions(ctl).values())
    assert not ctl.cell_summaries.later and kept_differs(ctl) == []

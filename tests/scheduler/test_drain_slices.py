"""A flip's drain moves a bounded slice of its requests a tick (scheduler/control/drains.py):
it finishes over several ticks, every request owned exactly once at every step, nothing lost,
and a scheduler restarted mid-drain finishes it from the store alone."""

from __future__ import annotations

from sched_fakes import FakeCell, Harness, hand_over, pump, until_held

from scheduler.control.drains import DRAIN_MOVES_PER_TICK

REQUESTS = 4
"""The harness completes four requests at once."""
PER_TICK = 1


def _fleet(tmp_path, path: str = "reprefill") -> tuple[Harness, list[FakeCell], list]:
    """c0 holds every request; c1 has room for all of them; a drain moves `PER_TICK` a tick."""
    h = Harness(str(tmp_path / "s.sqlite"), migration={"path": path})
    c0 = FakeCell(h.client, "c0", max_running=8)
    c0.register(), c0.sync()
    futs = [h.complete({"prompt_ids": [i, i + 1], "max_tokens": 6}, session=f"s{i}") for i in range(REQUESTS)]
    until_held(c0, count=REQUESTS)
    c0.step(2), c0.sync()
    c1 = FakeCell(h.client, "c1", max_running=8)
    c1.register(), c1.sync()
    h.ctl.flips.slices.per_tick = PER_TICK
    return h, [c0, c1], futs


def _owners(h: Harness) -> dict[str, str]:
    """request → the cell that owns it, of the requests not finished."""
    rows = h.ctl.store.execute("SELECT id, cell_id FROM requests WHERE state NOT IN ('finished', 'failed')")
    return dict(rows.fetchall())


def _restart(h: Harness, cells: list[FakeCell], per_tick: int) -> Harness:
    h.close()
    h2 = Harness(h.db_path, migration={"path": "reprefill"})
    for c in cells:
        c.client = h2.client
    h2.ctl.flips.slices.per_tick = per_tick
    return h2


def _finish_flip(h: Harness, cells: list[FakeCell], fid: str) -> dict:
    for _ in range(6):
        h.tick()
        for c in cells:
            c.sync()
    return h.client.get(f"/v1/flips/{fid}").json()


def test_a_drain_moves_a_slice_a_tick_and_finishes_with_nothing_lost(tmp_path):
    h, cells, futs = _fleet(tmp_path)
    c0, c1 = cells
    try:
        fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
        on_c0 = []
        for _ in range(4):
            h.tick()
            owners = _owners(h)
            assert len(owners) == REQUESTS  # every request owned, by exactly one cell, at every step
            on_c0.append(sum(1 for c in owners.values() if c == "c0"))
            h.check()
            for c in cells:
                c.sync()
        assert on_c0 == [3, 2, 1, 0]  # one a tick, not all in the first
        flip = _finish_flip(h, cells, fid)
        assert flip["state"] == "done" and flip["recomputed"] == REQUESTS and flip["suspended"] == 0
        pump(cells, rounds=200, harness=h, until=futs)
        for fut in futs:
            assert len(fut.result(timeout=60).json()["token_ids"]) == 6
    finally:
        h.close()


def test_a_budget_as_large_as_the_drain_moves_it_in_one_tick(tmp_path):
    h, cells, _ = _fleet(tmp_path)
    try:
        h.ctl.flips.slices.per_tick = DRAIN_MOVES_PER_TICK  # negative control of the slicing: the default
        h.client.post("/v1/flips", json={"cell": "c0", "to": "training"})
        h.tick()
        assert sum(1 for c in _owners(h).values() if c == "c0") == 0
        assert len(_owners(h)) == REQUESTS
    finally:
        h.close()


def test_kv_copies_are_started_a_slice_a_tick(tmp_path):
    h, cells, futs = _fleet(tmp_path, path="auto")
    c0, c1 = cells
    try:
        fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
        started = []
        for _ in range(4):
            h.tick()
            c0.sync()
            started.append(len(c0.migrations_out))
        assert started == [1, 2, 3, 4]  # the copies under way stay counted on the source, not started again
        c1.sync()
        for mid in list(c0.migrations_out):
            hand_over(c0, c1, mid)
        flip = _finish_flip(h, cells, fid)
        assert flip["state"] == "done" and flip["migrated"] == REQUESTS
        pump(cells, rounds=200, harness=h, until=futs)
        assert all(len(f.result(timeout=60).json()["token_ids"]) == 6 for f in futs)
    finally:
        h.close()


def test_a_drain_cut_by_a_restart_finishes_once(tmp_path):
    h, cells, futs = _fleet(tmp_path)
    c0, c1 = cells
    fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
    h.tick()
    for c in cells:
        c.sync()
    assert sum(1 for c in _owners(h).values() if c == "c0") == REQUESTS - PER_TICK  # cut mid-drain
    h = _restart(h, cells, PER_TICK)
    try:
        h.tick()
        for c in cells:
            c.sync()
        h.tick()
        assert h.ctl.ready
        owners = _owners(h)
        assert len(owners) == REQUESTS and sum(1 for c in owners.values() if c == "c0") == REQUESTS - 2 * PER_TICK
        flip = _finish_flip(h, cells, fid)
        assert flip["state"] == "done" and flip["recomputed"] == REQUESTS
        assert [s for s, *_ in flip["history"]].count("draining") == 1
        assert all(c == "c1" for c in _owners(h).values()) and len(_owners(h)) == REQUESTS
        pump(cells, rounds=60, harness=h)
        counts = h.ctl.store.owners.count_requests()
        assert set(counts) == {"finished"} and counts["finished"] == REQUESTS, counts
    finally:
        h.close()


def test_a_steps_slices_share_one_snapshot_until_a_cell_changes_state(tmp_path):
    """A hundred nearly drained cells moving one request each built a hundred snapshots a
    step; now one, built again only after a cell changed state (its old state must not place)."""
    h, _, _ = _fleet(tmp_path)
    slices, store = h.ctl.flips.slices, h.ctl.store
    builds: list[int] = []
    real = slices.snapshot
    slices.snapshot = lambda: builds.append(1) or real()
    try:
        fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
        h.tick()  # the flip begins (the cell's state changes), then its first slice
        assert len(builds) == 1 and sum(1 for c in _owners(h).values() if c == "c0") == REQUESTS - 1

        def slice_one(fx) -> int:
            flip, cell = store.fleet.get_flip(fid), store.fleet.get_cell("c0")
            return slices.migrate_out(fx, flip, cell, store.owners.requests_on("c0")[:1])

        slices.per_tick = REQUESTS
        slices.begin_tick()
        with h.ctl.ctx.txn() as fx:
            assert slice_one(fx) == 1 and slice_one(fx) == 1
        assert len(builds) == 2  # two slices of one step: one snapshot
        with h.ctl.ctx.txn() as fx:
            slices.invalidate()  # as `Flips._set_cell` does
            assert slice_one(fx) == 1
        assert len(builds) == 3  # a state changed: the next slice read the cells again
        assert all(c == "c1" for c in _owners(h).values()) and len(_owners(h)) == REQUESTS
        h.check()
    finally:
        h.close()

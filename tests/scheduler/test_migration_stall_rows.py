"""Each migration's client-visible stall lands on its row (and in the export's migrations
column), measured on the scheduler's clock like the downtime histogram."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, flip_holder, hand_over, open_harness, pump


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _stalls(harness) -> dict[str, tuple[str, float | None]]:
    rows = harness.ctl.store.execute("SELECT id, path, stall_s FROM migrations").fetchall()
    return {m: (p, s) for m, p, s in rows}


def _exported(harness) -> list[dict]:
    rows, _ = harness.ctl.store.export.page(0, 10, 1 << 15)
    return [m for r in rows for m in r["migrations"]]


@pytest.mark.parametrize("gap", [0.5, 0.2])
def test_a_kv_moves_stall_is_on_its_row_and_exported(harness, gap):
    a, b, fut = flip_holder(harness, 10)
    mid = next(c["migration_id"] for c in a.commands if c["type"] == "migrate_out")
    harness.clock.advance(gap)  # the stop-and-copy: the client sees no token for `gap` seconds
    hand_over(a, b, mid)
    assert _stalls(harness)[mid] == ("kv", None)  # still in its window: not measured yet
    pump([a, b], until=fut, harness=harness)
    harness.client.post("/v1/sessions/m/finish", json={"reward": 1.0})
    path, stall = _stalls(harness)[mid]
    assert path == "kv" and stall == pytest.approx(gap, abs=1e-9)
    if gap != 0.5:  # negative control: the recording follows the clock, a fixed value would not
        assert stall != pytest.approx(0.5, abs=1e-3)
    text = harness.client.get("/metrics").text
    assert f"cellflip_migration_downtime_seconds_sum {stall}" in text  # the histogram saw the same move
    [m] = _exported(harness)
    assert (m["path"], m["stall_s"]) == ("kv", stall)


def test_a_reprefill_moves_stall_runs_to_the_first_token_on_the_destination(harness):
    c0, c1 = FakeCell(harness.client, "c0", kv_export=False), FakeCell(harness.client, "c1", kv_export=False)
    c0.register(), c1.register(), c0.sync(), c1.sync()
    fut = harness.complete({"prompt_ids": [3, 4], "max_tokens": 6}, session="r")
    for _ in range(500):
        c0.sync(), c1.sync()
        if c0.held or c1.held:
            break
    src, dst = (c0, c1) if c0.held else (c1, c0)
    src.step(2), src.sync()
    assert harness.client.post("/v1/flips", json={"cell": src.cell_id, "to": "training"}).status_code == 202
    harness.tick()
    src.sync(), dst.sync()
    harness.clock.advance(0.75)  # re-prefill on the destination
    pump([src, dst], until=fut, harness=harness)
    [(path, stall)] = _stalls(harness).values()
    assert path == "reprefill" and stall == pytest.approx(0.75, abs=1e-9)
    assert "cellflip_migration_downtime_seconds_count 0.0" in harness.client.get("/metrics").text  # KV copies only

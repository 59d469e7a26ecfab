"""A session's later turns go back to the cell that holds its KV, while it has room."""

from scheduler.planner.placement import sticky_destination
from scheduler.planner.types import CellSummary, RequestSummary, Snapshot


def _cell(cid, state="rollout", inflight=0, used=0):
    return CellSummary(cid, "n0", state, 0, inflight, capacity=4, kv_blocks_free=100 - used,
                       kv_blocks_total=100, generation=0, can_export_kv=True)


def _snap(cells):
    return Snapshot(cells=tuple(cells), finished_waiting=0, batch_size=1, training_in_progress=False,
                    min_rollout_cells=1, queued_sessions=0)


def test_sticky_destination_prefers_the_previous_cell_only_when_it_has_room():
    req = RequestSummary("r", 160, 0, "s")
    snap = _snap((_cell("a"), _cell("b")))
    assert sticky_destination(snap, "b", req).cell_id == "b"
    assert sticky_destination(snap, None, req) is None
    assert sticky_destination(_snap((_cell("a"), _cell("b", inflight=4))), "b", req) is None  # full
    assert sticky_destination(_snap((_cell("a"), _cell("b", state="draining"))), "b", req) is None
    assert sticky_destination(_snap((_cell("a"), _cell("b", used=95))), "b", req) is None  # no KV room
    assert sticky_destination(_snap((_cell("a"),)), "gone", req) is None

"""A session's later turns go back to the cell that holds its KV, while it has room."""

from scheduler.placement import CellView, RequestSummary, Snapshot, sticky_destination


def _cell(cid, state="rollout", inflight=0, used=0):
    return CellView(cid, state, 0, inflight, max_running=4, kv_blocks_used=used, kv_blocks_total=100, kv_export=True)


def test_sticky_destination_prefers_the_previous_cell_only_when_it_has_room():
    req = RequestSummary("r", 160, 0, "s")
    snap = Snapshot((_cell("a"), _cell("b")))
    assert sticky_destination(snap, "b", req).cell_id == "b"
    assert sticky_destination(snap, None, req) is None
    assert sticky_destination(Snapshot((_cell("a"), _cell("b", inflight=4))), "b", req) is None  # full
    assert sticky_destination(Snapshot((_cell("a"), _cell("b", state="draining"))), "b", req) is None
    assert sticky_destination(Snapshot((_cell("a"), _cell("b", used=95))), "b", req) is None  # no KV room
    assert sticky_destination(Snapshot((_cell("a"),)), "gone", req) is None

"""A request may name its own id (`X-Request-Id`) only on a replay's scheduler
(`scheduler.store.replay_request_ids`): refused elsewhere, and an id the store holds is a 409."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, pump, until_held


@pytest.mark.parametrize("allowed", [False, True])
def test_a_named_request_id_only_on_a_replays_scheduler(tmp_path, allowed):
    h = Harness(str(tmp_path / "s.sqlite"), store={"replay_request_ids": allowed})
    try:
        c = FakeCell(h.client, "c0")
        c.register(), c.sync()
        body = {"prompt_ids": [1, 2, 3], "max_tokens": 2, "seed": 5}
        head = {"X-Request-Id": "t-v1-s0-r0", "X-Session-Id": "replay-1"}
        if not allowed:
            r = h.client.post("/v1/generate", json=body, headers=head)
            assert r.status_code == 422 and "replay_request_ids" in r.text
            assert h.ctl.store.owners.get_request("t-v1-s0-r0") is None  # nothing recorded
            return
        fut = h.pool.submit(h.client.post, "/v1/generate", json=body, headers=head)
        until_held(c, fut)
        assert "t-v1-s0-r0" in c.held  # the cell samples under the recorded id (its noise's key)
        pump([c], until=fut)
        assert fut.result(timeout=30).json()["id"] == "t-v1-s0-r0"
        again = h.client.post("/v1/generate", json=body, headers={**head, "X-Session-Id": "replay-2"})
        assert again.status_code == 409 and "exists" in again.text
    finally:
        h.close()

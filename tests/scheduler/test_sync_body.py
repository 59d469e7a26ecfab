"""A sync's body parsed and validated in one pass (scheduler/api/internal.py `read_sync`) and its
token batches judged column by column (scheduler/control/trust.py, ingest.py): what FastAPI's
own parsing refused is still refused, with nothing stored, and an impossible record still
fences its cell."""

from __future__ import annotations

import json

import pytest

from tests.scheduler.sched_fakes import FakeCell, Harness, until_held
from tests.scheduler.storecheck import store_dump


@pytest.fixture
def h(tmp_path):
    harness = Harness(str(tmp_path / "sched.sqlite"), min_rollout_cells=1)
    yield harness
    harness.close()


def _post(h, cell: FakeCell, body: bytes | dict, content_type: str = "application/json"):
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    return h.client.post(f"/internal/v1/cells/{cell.cell_id}/sync", content=raw,
                         headers={**cell.headers, "Content-Type": content_type})


def test_a_malformed_sync_body_is_refused_and_nothing_is_stored(h):
    c = FakeCell(h.client, "c0", headers=h.auth("cell"))
    c.register(), c.sync()
    good = {"incarnation": c.incarnation, "summary": c.summary(), "tokens": [], "events": []}
    before = store_dump(h.db_path)
    r = _post(h, c, b'{"incarnation": ')
    assert r.status_code == 422 and "not valid JSON" in r.text
    r = _post(h, c, good, content_type="text/plain")
    assert r.status_code == 422 and "body" in r.json()["detail"]
    bad_records = {**good, "tokens": [{"request_id": "r", "epoch": 1, "start": 0, "records": [[1, -0.5, 0]]}]}
    r = _post(h, c, bad_records)
    assert r.status_code == 422 and "body.tokens.0.records" in r.json()["detail"]
    huge = {**good, "tokens": [{"request_id": "r", "epoch": 1 << 64, "start": 0, "records": []}]}
    r = _post(h, c, huge)
    assert r.status_code == 422 and "64-bit" in r.text
    assert store_dump(h.db_path) == before
    assert _post(h, c, good).status_code == 200  # the control: the same sync well formed
    assert _post(h, c, good, content_type="application/json; charset=utf-8").status_code == 200


@pytest.mark.parametrize("record, why", [
    ([1 << 31, -0.5, 0, False], "token id"),   # past int32: no tokenizer has such an id
    ([-1, -0.5, 0, False], "token id"),
    ([5, 0.25, 0, False], "log-prob"),           # a probability above 1
    ([5, -0.5, 7, False], "version"),            # never served to it
])
def test_an_impossible_record_fences_its_cell_and_a_possible_one_lands(h, record, why):
    cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
    cell.register(), cell.sync()
    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 4}, session="s")
    until_held(cell, fut)
    rid = next(iter(cell.held))
    # the control: the largest id int32 holds, a log-prob of 0, the served version: accepted
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0, "records": [[(1 << 31) - 1, 0.0, 0, False]],
                                "finish_reason": None})
    assert rid not in cell.sync()["rejected"]
    assert h.client.get("/v1/sessions/s", headers=h.auth("trainer")).json()["token_ids"] == [1, 2, (1 << 31) - 1]
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 1, "records": [record],
                                "finish_reason": None})
    r = cell.sync(expect=409)
    assert r["reason"] == "fenced" and why in r["detail"], r
    # nothing of it stored; what the quarantined cell sampled and no client was shown is taken back
    assert h.client.get("/v1/sessions/s", headers=h.auth("trainer")).json()["token_ids"] == [1, 2]

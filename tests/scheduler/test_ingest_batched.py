"""A sync's token batches are read and written together: what one batch of a sync adds, the
next batch of the same sync is judged against (continued, duplicated or contradicted)."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, open_harness, until_held


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _rec(i: int, tok: int | None = None) -> list:
    return [100 + i if tok is None else tok, -0.1 * (i + 1), 0, False]


def _start(harness, sessions: list[str]) -> tuple[FakeCell, list[str]]:
    c = FakeCell(harness.client, "c1", max_running=len(sessions))
    c.register()
    c.sync()
    futs = [harness.complete({"prompt_ids": [1], "max_tokens": 50}, session=s) for s in sessions]
    for k, f in enumerate(futs, 1):
        until_held(c, f, count=k)
    by_session = {h.session_id: rid for rid, h in c.held.items()}
    return c, [by_session[s] for s in sessions]


def _send(c: FakeCell, batches: list[tuple[str, int, list]]) -> list[str]:
    c.pending_tokens += [{"request_id": rid, "epoch": 1, "start": start, "records": recs, "finish_reason": None}
                         for rid, start, recs in batches]
    rejected = c.sync()["rejected"]
    return rejected


def test_batches_of_one_sync_continue_and_duplicate_each_other(harness):
    c, (a, b) = _start(harness, ["a", "b"])
    assert _send(c, [(a, 0, [_rec(0), _rec(1)]), (b, 0, [_rec(0)]), (a, 2, [_rec(2)]),
                     (a, 1, [_rec(1), _rec(2), _rec(3)])]) == []  # continue, then overlap + new
    assert harness.client.get("/v1/sessions/a").json()["token_ids"] == [1, 100, 101, 102, 103]
    assert harness.client.get("/v1/sessions/b").json()["token_ids"] == [1, 100]
    assert harness.ctl.store.owners.get_request(a).num_generated == 4


def test_a_contradiction_inside_one_sync_is_refused_and_the_rest_lands(harness):
    c, (a, b) = _start(harness, ["a", "b"])
    # a's second batch contradicts its first (in the same sync): refused as drift; b lands
    assert _send(c, [(a, 0, [_rec(0), _rec(1)]), (a, 1, [_rec(1, tok=999)]), (b, 0, [_rec(0)])]) == [a]
    assert harness.client.get("/v1/sessions/a").json()["token_ids"] == [1, 100, 101]  # the first batch stays
    assert harness.client.get("/v1/sessions/b").json()["token_ids"] == [1, 100]
    assert "cellflip_retokenization_drift_total 1.0" in harness.client.get("/metrics").text


def test_a_gap_inside_one_sync_is_refused(harness):
    c, (a,) = _start(harness, ["a"])
    assert _send(c, [(a, 0, [_rec(0)]), (a, 2, [_rec(2)])]) == [a]  # index 1 never came
    assert harness.client.get("/v1/sessions/a").json()["token_ids"] == [1, 100]


def test_rows_read_without_params_cannot_be_used_or_written_back(harness):
    """A sync reads its requests without decoding their params (`get_requests(params=False)`):
    such a row's params are refused by every use instead of reading as `{}`; a whole read is the
    control that works."""
    import json

    from scheduler.store.owners import UNREAD

    c, (a,) = _start(harness, ["a"])
    assert _send(c, [(a, 0, [_rec(0)])]) == []  # the sync path that reads them so
    owners = harness.ctl.store.owners
    whole = owners.get_requests([a])[a]
    assert whole.params == owners.get_request(a).params and whole.sampling().max_tokens == 50
    bare = owners.get_requests([a, "nope"], params=False)
    assert list(bare) == [a] and bare[a].params is UNREAD
    assert (bare[a].num_generated, bare[a].cell_id, bare[a].epoch) == (whole.num_generated, whole.cell_id, whole.epoch)
    with pytest.raises(ValueError, match="without its params"):
        owners.put_request(bare[a])
    with pytest.raises(TypeError):
        json.dumps(bare[a].params)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError: no SamplingParams from it
        bare[a].sampling()
    owners.put_request(whole)  # the control: a whole row writes back
    assert owners.get_request(a).params == whole.params

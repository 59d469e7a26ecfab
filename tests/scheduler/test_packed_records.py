"""The packed wire form of token batches (scheduler/contract/records.py): base64 of
little-endian id/log-prob/version/truncated arrays. It round-trips bit for bit; a malformed one
is refused (422) with nothing stored; an untrue value in it fences its cell as the row form
does; a cell's sync carries it through the real app, and the row form is still accepted."""

from __future__ import annotations

import base64
import json
import math
import struct
from array import array

import pytest

from cells.client import SchedulerClient
from scheduler.contract.protocol import SyncRequest, TokenBatch
from scheduler.contract.records import TokenRecords
from tests.scheduler.sched_fakes import FakeCell, Harness, until_held
from tests.scheduler.storecheck import store_dump

_LPS = [-0.0, -5e-324, -1.0000000000000002, -math.pi, -1e300]
"""Log-probs whose every bit matters: a negative zero, the least subnormal, one ulp below -1."""


def _bits(xs) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


def _wire(records: TokenRecords) -> TokenRecords:
    """`records` as a cell sends them (packed, JSON text) and as the scheduler reads them."""
    text = json.dumps(TokenBatch("r", 1, 0, records.packed()).to_dict())
    return TokenBatch.from_dict(json.loads(text)).records


def test_the_packed_form_round_trips_bit_for_bit():
    rows = [(7, lp, v, t) for lp, v, t in zip(_LPS, [0, 0, 3, 3, 9], [False, True, False, True, False])]
    got = _wire(TokenRecords.of(rows))
    assert got.is_packed and got.wire()["n"] == len(rows)
    assert _bits(got.logprobs) == _bits(_LPS) and list(got.versions) == [0, 0, 3, 3, 9]
    assert got == TokenRecords.of(rows) and got.rows() == [list(r) for r in rows]
    assert list(got) == rows and all(type(r.truncated) is bool for r in got)
    # the negative control: one ulp off, or a positive zero for the negative one, is not the same
    off = [math.nextafter(_LPS[2], 0.0) if i == 2 else x for i, x in enumerate(_LPS)]
    assert _bits(got.logprobs) != _bits(off) and got != TokenRecords.of([(7, x, 0, False) for x in off])
    assert _bits(_wire(TokenRecords.of([(1, 0.0, 0, False)])).logprobs) != _bits([-0.0])
    # all-false truncation is left off the wire; the row form reads back as rows
    assert "truncated" not in TokenRecords.of([(1, -0.5, 0, False)]).packed().wire()
    plain = TokenBatch.from_dict({"request_id": "r", "epoch": 1, "start": 0, "records": [[1, -0.5, 0, False]]})
    assert not plain.records.is_packed and plain.records == [(1, -0.5, 0, False)]


@pytest.fixture
def h(tmp_path):
    harness = Harness(str(tmp_path / "sched.sqlite"), min_rollout_cells=1)
    yield harness
    harness.close()


def _held(h) -> tuple[FakeCell, str]:
    cell = FakeCell(h.client, "c0", headers=h.auth("cell"))
    cell.register(), cell.sync()
    until_held(cell, h.complete({"prompt_ids": [1, 2], "max_tokens": 8}, session="s"))
    return cell, next(iter(cell.held))


def _b64(code: str, xs) -> str:
    return base64.b64encode(array(code, xs).tobytes()).decode()


def _packed(ids, lps, versions, n=None, truncated=None) -> dict:
    out = {"n": len(ids) if n is None else n, "ids": _b64("i", ids), "logprobs": _b64("d", lps),
           "versions": _b64("i", versions)}
    if truncated is not None:
        out["truncated"] = truncated
    return out


def _tokens(h) -> list[int]:
    return h.client.get("/v1/sessions/s", headers=h.auth("trainer")).json()["token_ids"]


@pytest.mark.parametrize("records, why", [
    ({**_packed([5], [-0.5], [0]), "ids": "!!not base64!!"}, "not base64"),
    ({**_packed([5], [-0.5], [0]), "logprobs": "AAAA"}, "bytes"),          # 3 bytes for one float64
    (_packed([5], [-0.5], [0], n=2), "bytes"),                             # n says 2, the arrays hold 1
    (_packed([5, 6], [-0.5, -0.5], [0]), "bytes"),                         # versions one short
    (_packed([5], [-0.5], [0], truncated=base64.b64encode(b"\x02").decode()), "0 or 1"),
    ({"n": 1, "ids": _b64("i", [5])}, "body.tokens.0.records"),            # a column missing
])
def test_a_malformed_packed_batch_is_refused_and_nothing_is_stored(h, records, why):
    cell, rid = _held(h)
    before = store_dump(h.db_path)
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0, "records": records, "finish_reason": None})
    r = cell.sync(expect=422)
    assert why in json.dumps(r), r
    assert store_dump(h.db_path) == before and _tokens(h) == [1, 2]
    # the control: the same batch well formed lands
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0, "records": _packed([5], [-0.5], [0]),
                                "finish_reason": None})
    assert rid not in cell.sync()["rejected"] and _tokens(h) == [1, 2, 5]


@pytest.mark.parametrize("ids, lp, version, why", [
    ([-1], -0.5, 0, "token id"),                 # int32 holds it; no tokenizer does
    ([5], math.inf, 0, "log-prob"),
    ([5], math.nan, 0, "log-prob"),
    ([5], 0.25, 0, "log-prob"),                  # a probability above 1
    ([5], -0.5, 7, "version"),                   # never served to it
])
def test_an_untrue_packed_batch_fences_its_cell_and_stores_nothing(h, ids, lp, version, why):
    cell, rid = _held(h)
    # the control: the largest int32 id, a log-prob of 0, the served version: accepted
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0,
                                "records": _packed([(1 << 31) - 1], [0.0], [0]), "finish_reason": None})
    assert rid not in cell.sync()["rejected"] and _tokens(h) == [1, 2, (1 << 31) - 1]
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 1, "records": _packed(ids, [lp], [version]),
                                "finish_reason": None})
    r = cell.sync(expect=409)
    assert r["reason"] == "fenced" and why in r["detail"], r
    assert _tokens(h) == [1, 2]  # nothing of it; the unshown token a quarantined cell sampled taken back


@pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")  # the cell client's own timeout
def test_a_cells_sync_carries_packed_records_through_the_real_app(h):
    cell, rid = _held(h)
    client = SchedulerClient("http://testserver")
    client.close()
    client.http = h.client
    h.client.headers.update(h.auth("cell"))
    records = TokenRecords.of([(11, -0.25, 0, False), (12, -5e-324, 0, True), (13, -0.0, 0, False)]).packed()
    req = SyncRequest(cell.incarnation, tokens=[TokenBatch(rid, 1, 0, records)])
    assert isinstance(req.to_dict()["tokens"][0]["records"], dict)  # packed on the wire
    assert client.sync(cell.cell_id, req).rejected == []
    assert _tokens(h) == [1, 2, 11, 12, 13]
    toks = h.client.get("/v1/sessions/s", headers=h.auth("trainer")).json()
    assert _bits(toks["logprobs"][2:]) == _bits([-0.25, -5e-324, -0.0])
    # an exact duplicate (row form this time) is idempotent; a changed one is a mismatch
    rows = [[11, -0.25, 0, False], [12, -5e-324, 0, True], [13, -0.0, 0, False]]
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0, "records": rows, "finish_reason": None})
    assert rid not in cell.sync()["rejected"]
    cell.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 0,
                                "records": _packed([11, 12, 14], [-0.25, -5e-324, -0.0], [0, 0, 0]),
                                "finish_reason": None})
    assert rid in cell.sync()["rejected"]

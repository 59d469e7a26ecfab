"""Text that JSON decodes but nothing downstream can encode: a lone UTF-16 surrogate in any
string field of any route is a clear 400 over a real socket, and nothing is recorded."""

from __future__ import annotations

import json

import pytest

from tests.scheduler.storecheck import rejected as _rejected
from tests.test_hostile_input import served  # noqa: F401  (the real app over a socket)

SURROGATES = ["\ud800", "x\udfff", "\udbff\udbff"]


def _register_body(cell_id: str) -> dict:
    return {"cell_id": cell_id, "incarnation": "inc-1", "address": "127.0.0.1:9001", "store_port": 29500,
            "capabilities": {"kv_export": True, "scoring": True, "weight_update": "staged", "batch_invariant": True,
                             "block_size": 16}, "kv_blocks_total": 64, "max_running": 8, "version": 0}


def _bodies(bad: str) -> list[tuple[str, dict]]:
    return [
        ("/v1/flips", {"cell": bad, "to": "training"}),
        ("/v1/flips", {"cell": "c0", "to": bad}),
        ("/v1/versions", {"version": 1, "source": {"host": bad, "port": 1}}),
        ("/v1/sessions/s1/finish", {"reward": 1.0, "group_id": bad}),
        ("/v1/generate", {"prompt_ids": [1, 2], "max_tokens": 2, "stop": [bad]}),
        ("/v1/generate", {"prompt_ids": [1, 2], bad: 1}),
        ("/internal/v1/cells/register", _register_body(bad)),
        ("/internal/v1/cells/register", {**_register_body("c9"), "address": bad}),
        ("/internal/v1/cells/c9/sync", {"incarnation": bad, "summary": {}, "tokens": [], "events": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": bad}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}], "stream": True}),
    ]


@pytest.mark.parametrize("bad", SURROGATES, ids=["high", "low", "two_highs"])
def test_lone_surrogates_are_refused_everywhere_and_record_nothing(served, bad):  # noqa: F811 (fixture)
    for path, body in _bodies(bad):
        raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\uXXXX escape
        assert "\\ud" in raw
        r = _rejected(served.http, served.db, "POST", path, 400, content=raw,
                      headers={"content-type": "application/json", "X-Session-Id": "sur"})
        err = r.json()
        assert err["reason"] == "invalid_text" and err["error"]["code"] == "invalid_text", (path, err)


def test_paired_surrogates_are_text(served):  # noqa: F811 (fixture)
    """An escaped astral character (a valid pair) is ordinary text and reaches the route."""
    raw = json.dumps({"cell": "cell-😀", "to": "training"})
    assert "\\ud83d\\ude00" in raw
    r = served.http.post("/v1/flips", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 404 and r.json()["reason"] != "invalid_text"  # an unknown cell, not bad text

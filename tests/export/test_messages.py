"""The OpenAI-format messages the gateway was sent, recorded per turn beside each request,
bounded per session (marked when truncated), exported in `messages`, deleted by retention."""

from __future__ import annotations

import json
import os

import pytest
from sched_fakes import FakeCell, Harness, pump, until_held

from cells.export.table import turn_messages
from scheduler.contract.config.store import RetainConfig

SYSTEM = {"role": "system", "content": "You add numbers."}


def _harness(tmp_path, **store):
    os.environ.pop("CELLFLIP_READER_TOKEN", None)
    return Harness(str(tmp_path / "s.sqlite"), **({"store": store} if store else {}))


def _chat(h, cell, sid: str, messages: list[dict], stream: bool = False) -> str:
    fut = h.pool.submit(h.client.post, "/v1/chat/completions",
                        json={"messages": messages, "max_tokens": 3, "stream": stream}, headers={"X-Session-Id": sid})
    until_held(cell, fut)
    pump([cell], until=fut)
    r = fut.result(timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"] or ""
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def _conversation(h, cell, sid: str, turns: int = 2, stream_from: int | None = None) -> list[list[dict]]:
    """`turns` chat turns, each resending the whole conversation (streamed from turn
    `stream_from` on); returns each turn's messages."""
    sent, msgs = [], [SYSTEM]
    for k in range(turns):
        msgs = msgs + [{"role": "user", "content": f"what is {k} + {k}?"}]
        sent.append(msgs)
        reply = _chat(h, cell, sid, msgs, stream=stream_from is not None and k >= stream_from)
        msgs = msgs + [{"role": "assistant", "content": reply}]
    h.client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    return sent


def _row(h, sid: str) -> dict:
    rows = h.client.get("/v1/export/trajectories", headers=h.auth("reader")).json()["items"]
    return next(r for r in rows if r["session_id"] == sid)


def _recorded_as_sent(row: dict, sent: list[list[dict]]) -> bool:
    """The check a reader makes: each turn's recording expands to the messages it sent."""
    return turn_messages(row["messages"]) == sent


def test_messages_as_sent_per_turn_beside_their_requests(tmp_path):
    h = _harness(tmp_path)
    try:
        c = FakeCell(h.client, "c0")
        c.register(), c.sync()
        sent = _conversation(h, c, "chat-1", turns=3, stream_from=2)  # the last turn streamed
        row = _row(h, "chat-1")
        rec = row["messages"]
        assert rec["truncated"] is False and rec["dropped_turns"] == 0
        assert [t["request_id"] for t in rec["turns"]] == [t["request_id"] for t in row["turns"]]
        assert [t["keep"] for t in rec["turns"]] == [0, 2, 4]  # only the new messages are stored
        assert [len(t["messages"]) for t in rec["turns"]] == [2, 2, 2]
        assert _recorded_as_sent(row, sent)
        # negative control: a wrong recording is caught by the same check
        h.ctl.store.execute("UPDATE session_messages SET messages=? WHERE session_id=? AND turn=1",
                            ('[{"role":"user","content":"what is 9 + 9?"}]', "chat-1"))
        assert not _recorded_as_sent(_row(h, "chat-1"), sent)
    finally:
        h.close()


def test_a_session_past_the_cap_is_marked_truncated_and_retention_deletes_it(tmp_path):
    h = _harness(tmp_path, messages_bytes=200)
    try:
        c = FakeCell(h.client, "c0")
        c.register(), c.sync()
        sent = _conversation(h, c, "chat-a", turns=3)
        rec = _row(h, "chat-a")["messages"]
        assert rec["truncated"] is True and rec["dropped_turns"] >= 1
        assert rec["turns"][0]["messages"] == sent[0]  # the turns within the cap are whole
        assert [t["messages"] is None for t in rec["turns"]] == sorted(t["messages"] is None for t in rec["turns"])
        assert turn_messages(rec)[-1] is None and len(turn_messages(rec)) == 3  # every turn is there, marked
        _conversation(h, c, "chat-b", turns=1)  # the newest session (retention keeps its row)
        h.client.post("/v1/trajectories/outcomes", json={"outcomes": {"chat-a": {"status": "trained"}}},
                      headers=h.auth("trainer"))
        st = h.ctl.store
        assert st.execute("SELECT COUNT(*) FROM session_messages WHERE session_id='chat-a'").fetchone()[0] == 3
        h.client.portal.call(lambda: st.retention.purge(RetainConfig(count=0)))
        assert st.execute("SELECT COUNT(*) FROM session_messages WHERE session_id='chat-a'").fetchone()[0] == 0
        assert st.execute("SELECT COUNT(*) FROM session_messages WHERE session_id='chat-b'").fetchone()[0] == 1
    finally:
        h.close()


@pytest.mark.parametrize("cap", [0])
def test_a_zero_cap_records_nothing(tmp_path, cap):
    h = _harness(tmp_path, messages_bytes=cap)
    try:
        c = FakeCell(h.client, "c0")
        c.register(), c.sync()
        _conversation(h, c, "chat-z", turns=1)
        assert _row(h, "chat-z")["messages"] is None
    finally:
        h.close()

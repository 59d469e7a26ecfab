"""One bad request or one bad cell must not hurt the fleet. Each test reproduces an attack that
worked before (a registered fake cell, a turn racing a generate, a bogus version, refusals that
came back as success) and checks the mechanism that now makes it fail, with the store compared
before and after where nothing may change."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from array import array

import pytest

from scheduler.contract.probe import PROBE_LEN
from scheduler.store import Store
from tests.scheduler.sched_fakes import FakeCell, Harness, keep_alive, pump, token_of, until_held
from tests.scheduler.storecheck import store_dump

LIMITS = {"vocab_size": 1024, "max_context": 64, "output_ranges": [[0, 1000]]}
"""The fake model's limits (the fake cells sample ids below 1000)."""


@pytest.fixture
def h(tmp_path):
    harness = Harness(str(tmp_path / "sched.sqlite"), min_rollout_cells=1)
    yield harness
    harness.close()


def _cells(h, n: int, **kw) -> list[FakeCell]:
    out = []
    for i in range(n):
        c = FakeCell(h.client, f"cell-{i}", headers=h.auth("cell"), caps=LIMITS, **kw)
        c.register(), c.sync()
        out.append(c)
    return out


def _trust(h, cell_id: str) -> str:
    return h.client.get(f"/v1/cells/{cell_id}").json()["trust"]


# ------------------------------------------------------------------ a fake cell


def test_a_fake_cell_is_refused_at_registration_or_counts_for_nothing(h):
    real = _cells(h, 2)
    assert [_trust(h, c.cell_id) for c in real] == ["verified", "verified"]  # their probes agree
    # a process that does not run the model gives another answer: refused, nothing recorded
    before = store_dump(h.db_path)
    liar = FakeCell(h.client, "evil-3", headers=h.auth("cell"), caps=LIMITS,
                    probe=[-0.5] * (PROBE_LEN - 1))
    assert liar.register(expect=409)["reason"] == "probe_mismatch"
    assert store_dump(h.db_path) == before
    # one that claims it cannot score is let in, unverified: no capacity to guarantee
    mute = FakeCell(h.client, "evil-4", headers=h.auth("cell"), caps=LIMITS, scoring=False)
    mute.register(), mute.sync()
    assert _trust(h, "evil-4") == "unverified"
    first = h.client.post("/v1/flips", json={"cell": "cell-0", "to": "training"}, headers=h.auth("trainer"))
    assert first.status_code == 202
    # the last verified rollout cell may not go: the unverified one is no capacity
    second = h.client.post("/v1/flips", json={"cell": "cell-1", "to": "training"}, headers=h.auth("trainer"))
    assert second.status_code == 409 and second.json()["reason"] == "min_rollout_cells"
    # other limits than the fleet's: refused
    odd = FakeCell(h.client, "odd", headers=h.auth("cell"), caps={**LIMITS, "max_context": 32})
    assert odd.register(expect=409)["reason"] == "model_mismatch"


def test_a_live_cells_id_cannot_be_taken_over_but_by_an_admin(h):
    real = _cells(h, 2)
    thief = FakeCell(h.client, "cell-0", headers=h.auth("cell"), caps=LIMITS)
    before = store_dump(h.db_path)
    assert thief.register(expect=409)["reason"] == "cell_id_in_use"
    assert store_dump(h.db_path) == before
    real[0].sync()  # the real one goes on
    admin = FakeCell(h.client, "cell-0", headers=h.auth("admin"), caps=LIMITS)
    admin.register()  # an operator replacing a wedged process
    real[0].sync(expect=409)


def _placed(h, cells: list[FakeCell], fut) -> FakeCell:
    """Sync `cells` until one of them holds the request in `fut`; returns it."""
    for _ in range(200):
        for c in cells:
            c.sync()
        holder = next((c for c in cells if c.held), None)
        if holder is not None:
            return holder
        assert not fut.done(), fut.result().text
        time.sleep(0.002)
    raise AssertionError("the request was never placed")


def _report_oov(h, holder: FakeCell) -> str:
    """`holder` reports two plausible tokens (accepted), then one outside the model's output
    ids: it is fenced and quarantined. Returns the request id."""
    holder.step(2)
    holder.sync()  # two honest-looking tokens, accepted
    rid = next(iter(holder.held))
    holder.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 2, "records": [[1010, -0.1, 0, False]],
                                  "finish_reason": None})  # outside the model's output ids
    assert holder.sync(expect=409)["reason"] == "fenced"
    assert _trust(h, holder.cell_id) == "quarantined"
    return rid


def _samplers(h, session: str) -> list[str | None]:
    with sqlite3.connect(h.db_path) as conn:  # beside the live scheduler: read only, no Store
        rows = conn.execute("SELECT n, cell FROM token_chunks WHERE session_id=? ORDER BY start", (session,))
        return [cell for n, cell in rows for _ in range(n)]


def test_a_quarantined_cells_tokens_nobody_was_shown_are_sampled_again_by_a_trusted_cell(h):
    """A whole answer (no stream) shows nothing until it returns: when its sampler is
    quarantined mid-way, the tokens it sampled are taken back and a trusted cell samples them
    again from there; the client gets one answer, all of it from the trusted cell, and the
    session is trained on."""
    cells = _cells(h, 2)
    fut = h.complete({"prompt_ids": [1, 2, 3], "max_tokens": 8}, session="victim", headers=h.auth("agent"))
    holder = _placed(h, cells, fut)
    other = next(c for c in cells if c is not holder)
    assert _samplers(h, "victim") == [None] * 3
    rid = _report_oov(h, holder)
    assert h.client.get("/v1/sessions/victim").json()["token_ids"] == [1, 2, 3]  # taken back at once
    pump([other], until=fut, harness=h)  # the loop re-places it
    answer = fut.result(timeout=30).json()
    assert answer["finish_reason"] == "length"
    assert answer["token_ids"] == [token_of(rid, i) for i in range(8)]  # the fake model's own tokens, in order
    sess = h.client.get("/v1/sessions/victim").json()
    assert sess["token_ids"] == [1, 2, 3, *answer["token_ids"]]
    assert _samplers(h, "victim") == [None] * 3 + [other.cell_id] * 8  # nothing of the rogue's is left
    assert h.client.post("/v1/sessions/victim/finish", json={"reward": 1.0},
                         headers=h.auth("trainer")).status_code == 200
    out = h.client.get("/v1/trajectories", headers=h.auth("trainer")).json()["trajectories"]
    assert [t.get("dropped") for t in out] == [None]  # trained on
    metrics = h.client.get("/metrics").text
    assert "cellflip_tokens_resampled_total 2.0" in metrics and "cellflip_sessions_tainted_total 0.0" in metrics


def test_a_chat_turn_without_stream_gets_its_answer_from_the_trusted_cell(h):
    """The same take-back through the OpenAI-compatible gateway: a chat turn without `stream`
    returns one answer, none of it the quarantined cell's, and the session is trained on."""
    caps = {"vocab_size": 152_000, "max_context": 4096, "output_ranges": [[0, 1000]]}
    cells = []
    for i in range(2):
        c = FakeCell(h.client, f"cell-{i}", headers=h.auth("cell"), caps=caps)
        c.register(), c.sync()
        cells.append(c)
    fut = h.pool.submit(h.client.post, "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                        headers={**h.auth("agent"), "X-Session-Id": "chat-victim"})
    holder = _placed(h, cells, fut)
    other = next(c for c in cells if c is not holder)
    before = len(h.client.get("/v1/sessions/chat-victim").json()["token_ids"])
    rid = _report_oov(h, holder)
    pump([other], until=fut, harness=h)
    r = fut.result(timeout=30)
    assert r.status_code == 200, r.text
    sess = h.client.get("/v1/sessions/chat-victim").json()
    assert sess["token_ids"][before:] == [token_of(rid, i) for i in range(8)]
    assert _samplers(h, "chat-victim")[before:] == [other.cell_id] * 8
    assert r.json()["usage"]["completion_tokens"] == 8


def test_a_quarantined_cells_tokens_a_stream_showed_stay_and_are_never_trained(h):
    """Negative control of the take-back: a stream showed the rogue's tokens as they came, so
    they stay (the store keeps what its client saw); the request goes on from there on the
    trusted cell without breaking the stream, and the session is never trained on."""
    cells = _cells(h, 2)
    body = {"prompt_ids": [1, 2, 3], "max_tokens": 8, "stream": True}
    fut = h.pool.submit(h.client.post, "/v1/generate", json=body,
                        headers={**h.auth("agent"), "X-Session-Id": "victim"})
    holder = _placed(h, cells, fut)
    other = next(c for c in cells if c is not holder)
    rid = _report_oov(h, holder)
    pump([other], until=fut, harness=h)  # re-placed as it is
    events = [json.loads(x[6:]) for x in fut.result(timeout=30).text.splitlines()
              if x.startswith("data: ") and x != "data: [DONE]"]
    shown = [t for e in events for t in e["token_ids"]]
    assert events[-1]["finish_reason"] == "length" and len(shown) == 8
    sess = h.client.get("/v1/sessions/victim").json()
    assert sess["token_ids"] == [1, 2, 3, *shown]  # the store keeps what its client saw
    assert 1010 not in sess["token_ids"] and shown == [token_of(rid, i) for i in range(8)]
    assert _samplers(h, "victim") == [None] * 3 + [holder.cell_id] * 2 + [other.cell_id] * 6
    fut2 = h.complete({"prompt_ids": [], "max_tokens": 3}, session="victim", headers=h.auth("agent"))
    until_held(other, fut2)
    pump([other], until=fut2)
    assert fut2.result(timeout=30).status_code == 200
    assert h.client.post("/v1/sessions/victim/finish", json={"reward": 1.0},
                         headers=h.auth("trainer")).status_code == 200
    out = h.client.get("/v1/trajectories", headers=h.auth("trainer")).json()["trajectories"]
    assert [t.get("dropped") for t in out] == ["untrusted"]
    metrics = h.client.get("/metrics").text
    assert "cellflip_cells_quarantined_total 1.0" in metrics and "cellflip_sessions_tainted_total 1.0" in metrics
    assert "cellflip_tokens_resampled_total 0.0" in metrics


def test_log_probs_a_verified_scorer_contradicts_quarantine_the_sampler_and_drop_its_trajectory(h):
    a, b = _cells(h, 2)
    fut = h.complete({"prompt_ids": [5, 6], "max_tokens": 3}, session="s1", headers=h.auth("agent"))
    holder = None
    for _ in range(200):
        for c in (a, b):
            c.sync()
        holder = next((c for c in (a, b) if c.held), None)
        if holder is not None:
            break
        time.sleep(0.002)
    other = b if holder is a else a
    pump([holder], until=fut)
    assert h.client.post("/v1/sessions/s1/finish", json={"reward": 1.0}, headers=h.auth("trainer")).status_code == 200
    # the scorer (verified, not the sampler) finds one token impossible (-inf): never stored
    before_tokens = h.client.get("/v1/sessions/s1").json()
    other.events.append({"type": "scored", "session_id": "s1", "start": 2,
                         "old_logprobs": [-0.25, float("-inf"), -0.252], "version": 0})
    raw = json.dumps({"incarnation": other.incarnation, "summary": other.summary(), "tokens": [],
                      "events": other.events, "wait_s": 0.0})
    other.events = []
    r = h.client.post(f"/internal/v1/cells/{other.cell_id}/sync", content=raw,
                      headers={**h.auth("cell"), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert _trust(h, holder.cell_id) == "quarantined" and _trust(h, other.cell_id) == "verified"
    sess = h.client.get("/v1/sessions/s1").json()
    assert sess["token_ids"] == before_tokens["token_ids"]  # a finished trajectory is kept, never trained
    assert all(x is None or x <= 0 for x in sess["old_logprobs"])  # nothing non-finite stored
    out = h.client.get("/v1/trajectories", headers=h.auth("trainer")).json()["trajectories"]
    assert [t.get("dropped") for t in out] == ["untrusted"]


def test_a_cross_check_that_agrees_verifies_nothing_away(h):
    """Negative control of the cross-check: the scorer's exact log-probs equal what the sampler
    reported (bit for bit) and nobody is quarantined."""
    a, b = _cells(h, 2)
    fut = h.complete({"prompt_ids": [5, 6], "max_tokens": 3}, session="s2", headers=h.auth("agent"))
    holder = None
    for _ in range(200):
        for c in (a, b):
            c.sync()
        holder = next((c for c in (a, b) if c.held), None)
        if holder is not None:
            break
        time.sleep(0.002)
    other = b if holder is a else a
    pump([holder], until=fut)
    lps = [x for x in h.client.get("/v1/sessions/s2").json()["logprobs"] if x is not None]
    other.events.append({"type": "scored", "session_id": "s2", "start": 2, "old_logprobs": lps, "version": 0})
    other.sync()
    assert _trust(h, holder.cell_id) == "verified"
    assert h.client.get("/v1/sessions/s2").json()["provenance"][2:] == ["exact"] * 3


def _sample_and_score(h, cells: list[FakeCell], session: str, switch_before_decoding: bool) -> FakeCell:
    """A request placed on one of `cells` serving version 0 (1 when not
    `switch_before_decoding`), decoded under version 1 (switched after the placement when
    `switch_before_decoding`: its prompt's KV is version 0's), then the scoring task of version
    1, answered by the other cell with other log-probs than reported. Returns the sampler."""
    for c in cells:
        c.version, c.versions_held = (0 if switch_before_decoding else 1), [0, 1]
        c.sync()
    fut = h.complete({"prompt_ids": [5, 6], "max_tokens": 3}, session=session, headers=h.auth("agent"))
    sampler = None
    for _ in range(200):
        for c in cells:
            c.sync()
        sampler = next((c for c in cells if c.held), None)
        if sampler is not None:
            break
        time.sleep(0.002)
    scorer = next(c for c in cells if c is not sampler)
    sampler.version = 1
    pump([sampler], until=fut)
    assert fut.result(timeout=30).status_code == 200
    assert h.client.get(f"/v1/sessions/{session}").json()["versions"][2:] == [1, 1, 1]
    assert h.client.post(f"/v1/sessions/{session}/finish", json={"reward": 1.0},
                         headers=h.auth("trainer")).status_code == 200
    task = None
    for _ in range(20):  # scoring passes run every score_interval_s (0.2 s)
        h.clock.advance(0.25)
        h.tick()
        for c in cells:
            c.sync()
        task = next((x for x in scorer.commands if x["type"] == "score" and x["session_id"] == session), None)
        if task is not None:
            break
    assert task is not None and task["version"] == 1
    scorer.events.append({"type": "scored", "session_id": session, "start": task["start"],
                          "old_logprobs": [-0.9] * (task["end"] - task["start"]), "version": 1,
                          "task_id": task["task_id"], "seconds": 0.01})
    scorer.sync()
    return sampler


def test_a_request_continued_over_a_version_change_is_not_cross_checked_against_the_new_version(h):
    """A cell that changes version mid-request continues over KV of the previous version: its
    tokens carry the new version but their log-probs are honestly not its exact ones. Only
    requests the sampler took up already serving the scored version are compared; the
    control (placed after the switch, the same disagreement) quarantines."""
    assert h.client.post("/v1/versions", json={"version": 1}, headers=h.auth("trainer")).status_code == 201
    cells = _cells(h, 2)
    sampler = _sample_and_score(h, cells, "continued", switch_before_decoding=True)
    assert [_trust(h, c.cell_id) for c in cells] == ["verified", "verified"]
    sampler = _sample_and_score(h, cells, "fresh", switch_before_decoding=False)
    assert _trust(h, sampler.cell_id) == "quarantined"


def test_a_restart_on_a_store_holding_non_finite_records_comes_up(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    c = FakeCell(h.client, "c0")
    c.register(), c.sync()
    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 2}, session="old")
    until_held(c, fut)
    pump([c], until=fut)
    h.close()
    store = Store(str(tmp_path / "sched.sqlite"))  # what an older scheduler let in
    with store.tx():
        for c in store.sessions.buf.chunks("old"):
            if c.loss_mask:
                old, prov = c.scoring()
                c.logprobs = array("d", [float("nan")] * c.n)
                old[:], prov[:] = array("d", [float("-inf")] * c.n), bytearray([1] * c.n)
                store.sessions.buf.replace([c])
    store.close()
    again = Harness(str(tmp_path / "sched.sqlite"))
    try:
        r = again.client.get("/v1/sessions/old")
        assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text
        assert r.json()["old_logprobs"][2:] == [None, None]
        assert again.client.get("/metrics").status_code == 200
    finally:
        again.close()


# ------------------------------------------------------------------ one turn at a time


def test_a_chat_turn_racing_a_generate_on_one_session_records_nothing(h):
    (c,) = _cells(h, 1)
    agent = h.auth("agent")
    fut = h.complete({"prompt_ids": [1, 2, 3], "max_tokens": 4}, session="race-1", headers=agent)
    until_held(c, fut)
    before = store_dump(h.db_path)
    r = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]},
                      headers={**agent, "X-Session-Id": "race-1"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
    assert store_dump(h.db_path) == before  # the refused turn recorded nothing
    pump([c], until=fut)
    assert len(fut.result(timeout=30).json()["token_ids"]) == 4


def test_a_request_whose_session_moved_under_it_is_ended_not_replaced_forever(h):
    (c,) = _cells(h, 1)
    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 6}, session="m", headers=h.auth("agent"))
    until_held(c, fut)
    h.client.portal.call(h.ctl.store.sessions.append_prompt, "m", [9])  # a bug elsewhere, simulated
    c.step(1)
    body = c.sync()
    assert body["rejected"]
    answer = fut.result(timeout=30).json()
    assert answer["finish_reason"].startswith("error:") and "changed under" in answer["finish_reason"]
    assert 'cellflip_requests_failed_total 1.0' in h.client.get("/metrics").text


# ------------------------------------------------------------------ refusals before placement


@pytest.mark.parametrize("body,code", [
    ({"prompt_ids": [1, 2, 1024], "max_tokens": 2}, "bad_token"),  # past the vocabulary
    ({"prompt_ids": [1, 2], "max_tokens": 63}, "context_length_exceeded"),  # 2 + 63 > 64
    ({"prompt_ids": [1, 2], "max_tokens": 2, "stop_token_ids": [5000]}, "bad_token"),
])
def test_what_a_cell_would_refuse_is_refused_first_and_records_nothing(h, body, code):
    _cells(h, 1)
    before = store_dump(h.db_path)
    r = h.client.post("/v1/generate", json=body, headers={**h.auth("agent"), "X-Session-Id": "x"})
    assert r.status_code == 422 and r.json()["reason"] == code, r.text
    assert store_dump(h.db_path) == before


def test_a_chat_turn_with_no_room_records_nothing(h):
    before = store_dump(h.db_path)  # no cell at all: 429
    r = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers={**h.auth("agent"), "X-Session-Id": "nocap"})
    assert r.status_code == 429
    assert store_dump(h.db_path) == before


def test_a_session_id_no_route_could_name_is_refused_everywhere(h):
    _cells(h, 1)
    for sid in ("a/b", "x" * 129, "sp ace"):
        r = h.client.post("/v1/generate", json={"prompt_ids": [1]}, headers={"X-Session-Id": sid})
        assert r.status_code == 422, (sid, r.status_code)


# ------------------------------------------------------------------ versions


def test_versions_are_bounded_and_a_retired_bogus_one_unblocks_the_lineage(h):
    trainer = h.auth("trainer")
    assert h.client.post("/v1/versions", json={"version": 4611686018427387903}, headers=trainer).status_code == 422
    assert h.client.post("/v1/versions", json={"version": 3}, headers=trainer).status_code == 201
    jump = h.client.post("/v1/versions", json={"version": 3 + 1001}, headers=trainer)
    assert jump.status_code == 422 and jump.json()["reason"] == "version_jump"
    assert h.client.post("/v1/versions", json={"version": 1003}, headers=trainer).status_code == 201
    assert h.client.post("/v1/versions", json={"version": 4}, headers=trainer).json()["reason"] == "version_not_newer"
    assert h.client.delete("/v1/versions/1003", headers=trainer).status_code == 200  # never active
    assert h.client.post("/v1/versions", json={"version": 4}, headers=trainer).status_code == 201


def test_a_version_source_must_be_vouched_for(h):
    (c,) = _cells(h, 1)
    trainer = h.auth("trainer")
    before = store_dump(h.db_path)
    r = h.client.post("/v1/versions", json={"version": 1, "source": {"host": "203.0.113.7", "port": 29500}},
                      headers=trainer)
    assert r.status_code == 422 and r.json()["reason"] == "source_not_vouched"
    assert store_dump(h.db_path) == before and not [x for x in c.sync()["commands"] if x["type"] == "load_version"]
    assert h.client.put("/v1/trainer/version-host", json={"host": "10.0.0.5", "port": 29600},
                        headers=trainer).status_code == 200
    ok = h.client.post("/v1/versions", json={"version": 1, "source": {"host": "10.0.0.5", "port": 29600}},
                       headers=trainer)
    assert ok.status_code == 201 and ok.json()["receivers"] == ["cell-0"]
    # a live cell's transfer endpoint is vouched for too (a version published by a cell)
    host, port = c.client.get("/v1/cells/cell-0").json()["address"].rpartition(":")[0], 29500
    assert h.client.post("/v1/versions", json={"version": 2, "source": {"host": host, "port": port}},
                         headers=trainer).status_code == 201


def test_a_cell_stuck_loading_rolls_back(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"), min_rollout_cells=0)
    try:
        (c,) = _cells(h, 1)
        flip = h.client.post("/v1/flips", json={"cell": "cell-0", "to": "training"}).json()["flips"][0]
        for _ in range(5):
            h.tick()
            c.sync()
        assert h.client.get(f"/v1/flips/{flip['id']}").json()["state"] == "done"
        h.client.put("/v1/trainer/version-host", json={"host": "10.0.0.5", "port": 29600})
        assert h.client.post("/v1/versions", json={"version": 1, "source": {"host": "10.0.0.5", "port": 29600}}
                             ).status_code == 201
        back = h.client.post("/v1/flips", json={"cell": "cell-0", "to": "rollout"}).json()["flips"][0]
        h.tick(2)
        c.sync()
        assert h.client.get(f"/v1/flips/{back['id']}").json()["state"] == "loading"
        for _ in range(6):  # the cell never loads version 1
            keep_alive(h, [c], 60.0)
            h.tick()
        out = h.client.get(f"/v1/flips/{back['id']}").json()
        assert out["state"] == "rolled_back" and "not loaded within" in out["reason"]
        assert h.client.get("/v1/cells/cell-0").json()["state"] == "training"
    finally:
        h.close()


# ------------------------------------------------------------------ the event loop


def test_rendering_a_turn_leaves_the_event_loop_free(h, monkeypatch):
    """A turn is rendered on a worker thread: while one render is held, the app still answers."""
    from scheduler.gateway.tito import planning

    release, entered = threading.Event(), threading.Event()
    original = planning.TurnPlanner._compose

    def slow(self, *a, **k):
        entered.set()
        release.wait(30)
        return original(self, *a, **k)

    monkeypatch.setattr(planning.TurnPlanner, "_compose", slow)
    t = threading.Thread(target=lambda: h.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
        headers={**h.auth("agent"), "X-Session-Id": "slow"}), daemon=True)
    t.start()
    assert entered.wait(30)
    try:
        assert h.client.get("/healthz").status_code == 200  # served while the render is held
    finally:
        release.set()
        t.join(30)


def test_a_loop_stall_does_not_expire_leases():
    from scheduler.control.stallclock import StallClock

    now = [100.0]
    clock = StallClock(lambda: now[0], grace_s=1.0)
    clock.beat()
    t0 = clock()
    now[0] += 14.0  # the loop held for 14 s: no beat ran
    assert clock() - t0 == pytest.approx(1.0)  # a handler asking now sees one grace second pass
    clock.beat()
    now[0] += 0.5
    clock.beat()
    assert clock() - t0 == pytest.approx(1.5)
    # negative control: a plain clock would have moved 14.5 s, past a 10 s lease
    assert now[0] - 100.0 == pytest.approx(14.5)


def test_the_405_names_every_method_served_at_the_path(h):
    r = h.client.delete("/v1/flips")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}


def test_asyncio_is_not_blocked_by_the_stall_clock_task():
    from scheduler.control.stallclock import StallClock

    async def main():
        clock = StallClock()
        task = asyncio.create_task(clock.run())
        await asyncio.sleep(0.3)
        task.cancel()
        return clock.stalled

    assert asyncio.run(main()) == 0.0


def test_a_body_longer_than_any_prompt_the_model_takes_is_refused_unread(h):
    """Once the model's context is known, a /v1/generate body (and, once the gateway computed
    its bound, a chat body) longer than any prompt within it could be is refused by its
    declared length, before a byte is read, and records nothing."""
    _cells(h, 1)  # the model's limits: a context of 64 tokens
    agent = {**h.auth("agent"), "X-Session-Id": "big", "content-type": "application/json"}
    before = store_dump(h.db_path)
    big = b'{"prompt_ids": [' + b"1, " * 40_000 + b'1], "max_tokens": 1}'  # 120 kB, under the 8 MB limit
    r = h.client.post("/v1/generate", content=big, headers=agent)
    assert r.status_code == 413 and "more than a prompt the model takes" in r.json()["detail"], r.text
    text = "word " * 40_000
    first = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                          headers=agent)
    assert first.status_code == 413 and "cannot hold a prompt" in first.text  # the route read it, and computed its bound
    again = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text * 10}]},
                          headers=agent)
    assert again.status_code == 413 and "more than a prompt the model takes" in again.text
    assert store_dump(h.db_path) == before
    small = h.client.post("/v1/generate", json={"prompt_ids": [1, 2, 5000], "max_tokens": 1},
                          headers=h.auth("agent"))
    assert small.json()["reason"] == "bad_token"  # under the bound: the route itself read and judged it


def test_a_request_that_ends_stuck_while_taken_back_keeps_its_session_from_training(h):
    """Edge of the take-back: re-placing the request is refused as stuck (taken from its owners
    too often without a token), so it ends instead of being sampled again: nothing was taken
    back, and the session holding the quarantined cell's tokens is never trained on."""
    from scheduler.control.ownership import MAX_FRUITLESS_REPLACEMENTS

    cells = _cells(h, 2)
    fut = h.complete({"prompt_ids": [1, 2, 3], "max_tokens": 8}, session="stuck", headers=h.auth("agent"))
    holder = _placed(h, cells, fut)
    holder.step(2)
    holder.sync()
    rid = next(iter(holder.held))
    h.ctl.ownership.fruitless[rid] = MAX_FRUITLESS_REPLACEMENTS - 1
    holder.pending_tokens.append({"request_id": rid, "epoch": 1, "start": 2, "records": [[1010, -0.1, 0, False]],
                                  "finish_reason": None})
    assert holder.sync(expect=409)["reason"] == "fenced"
    answer = fut.result(timeout=30).json()
    assert answer["finish_reason"].startswith("error: stuck"), answer
    assert h.client.post("/v1/sessions/stuck/finish", json={"reward": 1.0}, headers=h.auth("trainer")).status_code == 200
    out = h.client.get("/v1/trajectories", headers=h.auth("trainer")).json()["trajectories"]
    assert [t.get("dropped") for t in out] == ["untrusted"]

"""The toy agentic task: episodes, the tool, the reward, the harness, demos and branch trees."""

from __future__ import annotations

import json

import pytest

from cells.engine.embedded.model_spec import PRESETS
from cells.rl.objectives.tree import select_branches, serialize_tree
from cells.trainer.toy_task import (
    TOOLS,
    TOY_RENDERER,
    UNKNOWN,
    Demonstrator,
    HttpChat,
    LocalGateway,
    TaskSpec,
    answer_text,
    assistant_call_message,
    branch_groups,
    completion_ids,
    demo_token_sequences,
    demo_transcripts,
    lookup,
    make_episode,
    make_episodes,
    oracle_messages,
    output_token_ids,
    rollout_tree,
    run_episode,
    score_messages,
)

SPEC = TaskSpec()


def find(pred, start: int = 0):
    """The first episode satisfying `pred`."""
    for i in range(start, start + 5000):
        ep = make_episode(SPEC, i)
        if pred(ep):
            return ep
    raise AssertionError("no such episode")


def transcript(ep, assistant_turns):
    """User question, then each assistant turn followed by the tool's answers to its calls."""
    msgs = ep.messages()
    for k, m in enumerate(assistant_turns):
        m = dict(m)
        calls = [dict(tc, id=f"c{k}_{j}") for j, tc in enumerate(m.get("tool_calls") or [])]
        if calls:
            m["tool_calls"] = calls
        msgs.append(m)
        for tc in calls:
            msgs.append({"role": "tool", "tool_call_id": tc["id"],
                         "content": lookup(ep, tc["function"]["arguments"])})
    return msgs


# -- episodes and the tool --------------------------------------------------------------------
def test_episodes_are_deterministic_and_varied():
    a = make_episodes(SPEC, 300)
    assert a == make_episodes(SPEC, 300)
    assert make_episodes(TaskSpec(seed=1), 20) != a[:20]
    assert {len(e.items) for e in a} == {1, 2}
    assert {e.depth for e in a} == {1, 2, 3}  # chained lookups: long-tailed lengths
    for e in a:
        assert set(e.items) <= set(SPEC.items) and len(set(e.items)) == len(e.items)
        assert e.needed >= set(e.items)
        assert all(c in SPEC.codes for c in e.expected)


def test_lookup_tool():
    ep = find(lambda e: any(x.redirect for x in e.table.values()))
    item, entry = next((i, x) for i, x in ep.table.items() if x.redirect is not None)
    assert lookup(ep, json.dumps({"item": item})) == f"item {item}: see item {entry.redirect}"
    item, entry = next((i, x) for i, x in ep.table.items() if x.code is not None)
    assert lookup(ep, {"item": item}) == f"item {item}: code {entry.code}"
    assert lookup(ep, {"item": 99}) == "item 99: no such item"
    for bad in ('{"item": "3"}', "{not json", {"item": True}, {"x": 1}):
        assert lookup(ep, bad).startswith("error:")


# -- the reward ------------------------------------------------------------------------------
def test_reward_of_hand_made_transcripts():
    ep = find(lambda e: len(e.items) == 1 and e.depth == 1)
    (item,), (code,) = ep.items, ep.expected
    wrong = next(c for c in SPEC.codes if c != code)
    call = assistant_call_message([item])

    s = score_messages(ep, transcript(ep, [call, {"role": "assistant", "content": f"code: {code}"}]))
    assert (s.reward, s.solved, s.call_credit, s.code_credit) == (1.0, True, 1.0, 1.0)
    # right call, wrong code: call credit only
    s = score_messages(ep, transcript(ep, [call, {"role": "assistant", "content": f"code: {wrong}"}]))
    assert s.reward == pytest.approx(0.5) and not s.solved
    # a spurious extra lookup halves the call credit (Jaccard)
    other = next(i for i in SPEC.items if i != item)
    s = score_messages(ep, transcript(ep, [assistant_call_message([item, other]),
                                           {"role": "assistant", "content": f"code: {wrong}"}]))
    assert s.call_credit == pytest.approx(0.5) and s.reward == pytest.approx(0.25)
    # no lookup: a lucky guess still solves, `unknown` earns nothing
    assert score_messages(ep, transcript(ep, [{"role": "assistant", "content": code}])).reward == 1.0
    s = score_messages(ep, transcript(ep, [{"role": "assistant", "content": answer_text([UNKNOWN])}]))
    assert s.reward == 0.0 and s.answered
    # a transcript that ends on a call has no answer
    s = score_messages(ep, transcript(ep, [call]))
    assert not s.answered and s.reward == pytest.approx(0.5)
    # malformed arguments are no lookup
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "lookup", "arguments": "{item: 3"}}]}
    s = score_messages(ep, ep.messages() + [bad])
    assert s.looked_up == () and s.reward == 0.0


def test_reward_of_pairs_and_chains():
    ep = find(lambda e: len(e.items) == 2 and e.depth == 2 and e.expected[0] != e.expected[1])
    msgs = transcript(ep, oracle_messages(ep))
    assert score_messages(ep, msgs).reward == 1.0
    a, b = ep.expected
    swapped = msgs[:-1] + [{"role": "assistant", "content": answer_text([b, a])}]
    s = score_messages(ep, swapped)
    assert not s.solved and s.code_credit == 0.0 and s.reward == pytest.approx(0.5)
    half = msgs[:-1] + [{"role": "assistant", "content": answer_text([a, UNKNOWN])}]
    assert score_messages(ep, half).reward == pytest.approx(0.5 + 0.15)
    # stopping at the redirect: part of the chain looked up
    first = transcript(ep, oracle_messages(ep)[:1])
    s = score_messages(ep, first + [{"role": "assistant", "content": answer_text([a, b])}])
    assert 0 < s.call_credit < 1 and s.solved  # codes right (by luck) still solve


def test_oracle_parallel_calls_and_chains():
    ep = find(lambda e: len(e.items) == 2 and e.depth == 3)
    turns = oracle_messages(ep)
    assert len(turns) == ep.depth + 1
    assert len(turns[0]["tool_calls"]) == 2  # both items in one turn
    assert "tool_calls" not in turns[-1]


# -- the harness, the gateway and demos --------------------------------------------------------
def _scripted_episode(gw, engine, ep, sid, teacher=None):
    turns = (teacher or Demonstrator()).messages(ep)
    engine.script(sid, [completion_ids(gw.renderer, m) for m in turns])
    return run_episode(gw, ep, session_id=sid, max_turns=len(turns), group_id="g",
                       finish=gw.finish)


def test_run_episode_through_the_gateway():
    from scheduler.gateway.tito.memory import ReplayEngine

    engine = ReplayEngine()
    ep = find(lambda e: len(e.items) == 2 and e.depth == 2)
    with LocalGateway(engine) as gw:
        reward, stats = _scripted_episode(gw, engine, ep, "s1")
        traj = gw.trajectory("s1")
    assert reward == 1.0 and stats["turns"] == 3 and stats["max_parallel"] == 2
    assert traj["state"] == "finished" and traj["reward"] == 1.0 and traj["group_id"] == "g"
    assert traj["segment_starts"] == [0]  # every turn extended the session (no rewrite)
    # the recorded tokens are exactly the oracle's completions plus gateway prompt tokens
    sampled = [t for t, m in zip(traj["token_ids"], traj["loss_mask"]) if m]
    with LocalGateway(engine) as gw2:
        expect = [t for m in oracle_messages(ep) for t in completion_ids(gw2.renderer, m)]
    assert sampled == expect


def test_malformed_tool_call_ends_the_episode():
    ep = make_episode(SPEC, 0)

    def chat(messages, tools, session_id, **sampling):
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": {"name": 4}, "arguments": "{}"}}]}

    reward, stats = run_episode(chat, ep, session_id="m")
    assert reward == 0.0 and stats["turns"] == 1 and not stats["branches"][0]["answered"]


def test_demos_equal_what_the_http_gateway_records():
    """Demo token sequences are what the real router records for the same conversation."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from scheduler.gateway.router import make_chat_router
    from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine

    demos = demo_transcripts(6, seed=3, teacher=Demonstrator(p_skip=0.3))
    engine = ReplayEngine()
    backend = InMemoryBackend(engine)
    app = FastAPI()
    app.include_router(make_chat_router(backend, TOY_RENDERER))
    chat = HttpChat("http://testserver", client=TestClient(app))
    with LocalGateway(ReplayEngine()) as gw:
        renderer = gw.renderer
    for d in demos:
        turns = [m for m in d["messages"] if m["role"] == "assistant"]
        sid = "http-" + d["id"]
        engine.script(sid, [completion_ids(renderer, m) for m in turns])
        ep = make_episode(SPEC, int(d["id"].split("-")[-1]))
        reward, _ = run_episode(chat, ep, session_id=sid, max_turns=len(turns), finish=chat.finish)
        seg = backend.sessions[sid].segments
        assert len(seg) == 1
        assert seg[0].token_ids == d["token_ids"] and seg[0].loss_mask == d["loss_mask"]
        assert reward == d["reward"] and backend.sessions[sid].finished
    seqs = demo_token_sequences(6, seed=3, teacher=Demonstrator(p_skip=0.3))
    assert seqs == [(d["token_ids"], d["loss_mask"]) for d in demos]  # deterministic


def test_output_ids_cover_the_demos_and_match_the_preset():
    ids = set(output_token_ids())
    assert PRESETS["toy"].output_ids() == sorted(ids)
    for toks, mask in demo_token_sequences(20, seed=0, teacher=Demonstrator(0.3, 0.3)):
        assert {t for t, m in zip(toks, mask) if m} <= ids


def test_tools_render_in_the_prompt():
    demos = demo_token_sequences(1, seed=0)
    with LocalGateway(None) as gw:
        prompt = gw.renderer.render_ids(make_episode(SPEC, 0).messages(), TOOLS,
                                        add_generation_prompt=True)
        assert "lookup" in gw.renderer.tokenizer.decode(demos[0][0][: len(prompt)])


# -- branches and trees ----------------------------------------------------------------------
def test_branches_share_a_prefix_and_make_a_tree():
    from scheduler.gateway.tito.memory import ReplayEngine

    ep = find(lambda e: len(e.items) == 1 and e.depth == 2)
    engine = ReplayEngine()
    with LocalGateway(engine) as gw:
        turns = [completion_ids(gw.renderer, m) for m in oracle_messages(ep)]
        wrong = {"role": "assistant", "content": answer_text(
            [next(c for c in SPEC.codes if c != ep.expected[0])])}
        engine.script("t", turns)  # branch 0: the trunk's session
        engine.script("t.b1", turns[1:])
        engine.script("t.b2", [turns[1], completion_ids(gw.renderer, wrong)])
        reward, stats = run_episode(gw, ep, session_id="t", branches=3, group_id="g",
                                    finish=gw.finish)
        trajs = [gw.trajectory(b["session_id"]) for b in stats["branches"]]
    assert [b["reward"] for b in stats["branches"]] == [1.0, 1.0, 0.5]
    assert reward == pytest.approx(2.5 / 3)
    assert [t["group_id"] for t in trajs] == ["g"] * 3

    (group,) = branch_groups(trajs)
    assert group.stem == "t" and sorted(group.branches) == [0, 1, 2]
    tree, leaves = rollout_tree([group.branches[b] for b in range(3)])
    root = tree.nodes[0]
    # The shared prefix holds the first completion: sampled (mask 1) in branch 0, the same
    # tokens from the gateway's full render (mask 0) in the others; the root keeps mask 1.
    first = turns[0]
    p0 = trajs[0]["loss_mask"].index(1)
    span = slice(p0, p0 + len(first))
    assert all(t["token_ids"][span] == first for t in trajs)
    assert trajs[1]["loss_mask"][span] == [0] * len(first)
    assert root.loss_mask[span] == [True] * len(first)
    for b, leaf in enumerate(leaves):
        assert tree.branch_token_ids(leaf) == trajs[b]["token_ids"]
    ser = serialize_tree(tree, select_branches(tree, 3))
    assert ser.branches.shape == (3, len(ser.token_ids))
    assert len(ser.token_ids) < sum(len(t["token_ids"]) for t in trajs)

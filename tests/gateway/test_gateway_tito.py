"""TITO session logic without HTTP: extension, rewrites, truncation, atomicity, counters."""

from __future__ import annotations

import asyncio
import copy

import pytest
from gateway_harness import load_corpus, next_messages

from scheduler.gateway.tito.backend import BackendBusy, PrometheusCounters, SimpleCounters
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest
from scheduler.gateway.tito.tito import GatewayError, TitoGateway, canonical_arguments

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def req(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": messages, "tools": kw.pop("tools", TOOLS), **kw}
    )


async def turn(gw: TitoGateway, sid: str, messages, **kw):
    async with gw.session_lock(sid):
        plan = await gw.plan(sid, req(messages, **kw))
        return await gw.start(plan).run()


def make(renderer, **kw):
    engine = ReplayEngine()
    backend = InMemoryBackend(engine, **kw.pop("backend_kw", {}))
    counters = SimpleCounters()
    return engine, backend, TitoGateway(backend, renderer, counters, **kw)


def tool_completion(renderer, args: str, *, close: bool = True) -> list[int]:
    tok = renderer.tokenizer
    if renderer.name.startswith("qwen3"):
        ids = tok.encode(f'<tool_call>\n{{"name":"read_file","arguments":{args}}}\n</tool_call>')
    else:
        ids = tok.encode(
            f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{args}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        )
    return ids + ([renderer.close_token_id] if close else [])


def answer(renderer, text: str) -> list[int]:
    return renderer.tokenizer.encode(text) + [renderer.close_token_id]


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_corpus_sessions_bridge_and_render_diff_agree(renderers, name):
    """Both extension paths give the same buffer; it holds exactly the sampled tokens."""
    r = renderers[name]
    sessions = load_corpus(name, [0, 2, 4, 9])
    buffers = {}
    for use_bridge in (True, False):
        engine, backend, gw = make(r, use_bridge=use_bridge)

        async def run_all(engine=engine, backend=backend, gw=gw, use_bridge=use_bridge):
            for s in sessions:
                engine.script(s["id"], [t["completion_ids"] for t in s["turns"]])
                msgs = copy.deepcopy(s["messages"])
                prompts = []
                for t in s["turns"]:
                    res = await turn(gw, s["id"], msgs, tools=s["tools"])
                    assert res.completion_ids == t["completion_ids"]
                    assert res.invariant_ok and res.drift == 0
                    prompts.append(res.prompt_len)
                    msgs = next_messages(msgs, res.message, t, s["harness"])
                seg = backend.sessions[s["id"]].segments
                assert len(seg) == 1
                toks, mask = seg[0].token_ids, seg[0].loss_mask
                sampled = engine.sampled[s["id"]]
                assert [x for x, m in zip(toks, mask, strict=False) if m] == [
                    x for c in sampled for x in c
                ]
                for k, p in enumerate(prompts):  # prompt[k+1] starts with prompt[k] + completion[k]
                    assert toks[p : p + len(sampled[k])] == sampled[k]
                buffers[(use_bridge, s["id"])] = list(toks)

        asyncio.run(run_all())
        assert gw.counters.retokenization_drift_total == 0
        assert gw.counters.history_rewrites_total == 0
        assert gw.stats["render_diff" if not use_bridge else "bridge"] > 0
    for s in sessions:
        assert buffers[(True, s["id"])] == buffers[(False, s["id"])]


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_history_rewrite_starts_segment_with_loss_mask_rule(renderers, name):
    r = renderers[name]
    engine, backend, gw = make(r)
    c1 = tool_completion(r, '{"path":"a.py"}')
    c2 = answer(r, "HAVING it.")
    c3 = answer(r, "Again.")
    engine.script("s", [c1, c2, c3])

    async def go():
        msgs = [{"role": "user", "content": "read a.py"}]
        r1 = await turn(gw, "s", msgs)
        call = r1.message["tool_calls"][0]
        msgs = msgs + [r1.message, {"role": "tool", "tool_call_id": call["id"], "content": "x = 1"}]
        await turn(gw, "s", msgs)
        # The harness edits the first user message: a new segment.
        edited = copy.deepcopy(msgs)
        edited[0]["content"] = "read b.py instead"
        r3 = await turn(gw, "s", edited)
        return r3

    r3 = asyncio.run(go())
    assert gw.counters.history_rewrites_total == 1
    assert r3.kind == "rewrite" and r3.segment == 1
    segs = backend.sessions["s"].segments
    assert [s.reason for s in segs] == ["start", "history_rewrite"]
    # Old segment untouched: its sampled tokens keep mask 1, in their own context.
    assert [t for t, m in zip(segs[0].token_ids, segs[0].loss_mask, strict=False) if m] == c1 + c2
    # New segment: the re-rendered prompt (including the old assistant turn) is all mask 0.
    new = segs[1]
    assert new.loss_mask == [0] * r3.prompt_len + [1] * len(c3)
    assert new.token_ids[r3.prompt_len :] == c3


def test_reserialised_arguments_are_not_a_rewrite():
    assert canonical_arguments('{"a":1,"b":false}') == canonical_arguments("{'b': False, 'a': 1}")
    assert canonical_arguments('{"a": null}') == canonical_arguments("{'a': None}")
    assert canonical_arguments({"a": [1, 2]}) == canonical_arguments(
        '{\n  "a": [\n    1,\n    2\n  ]\n}'
    )
    assert canonical_arguments('{"a": 1}') != canonical_arguments('{"a": 2}')
    assert canonical_arguments("not json") == '"not json"'


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_changed_arguments_are_a_rewrite(renderers, name):
    r = renderers[name]
    engine, backend, gw = make(r)
    engine.script("s", [tool_completion(r, '{"path":"a.py"}'), answer(r, "ok")])

    async def go():
        msgs = [{"role": "user", "content": "read"}]
        r1 = await turn(gw, "s", msgs)
        echo = copy.deepcopy(r1.message)
        echo["tool_calls"][0]["function"]["arguments"] = '{"path": "other.py"}'
        tid = echo["tool_calls"][0]["id"]
        await turn(gw, "s", msgs + [echo, {"role": "tool", "tool_call_id": tid, "content": "x"}])

    asyncio.run(go())
    assert gw.counters.history_rewrites_total == 1
    assert len(backend.sessions["s"].segments) == 2


@pytest.mark.parametrize("use_bridge", [True, False])
@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_truncated_completion_gets_close_token(renderers, name, use_bridge):
    r = renderers[name]
    engine, backend, gw = make(r, use_bridge=use_bridge)
    full = tool_completion(r, '{"path":"a.py"}')
    engine.script("s", [full, answer(r, "fine")])

    async def go():
        msgs = [{"role": "user", "content": "read"}]
        r1 = await turn(gw, "s", msgs, max_tokens=4)
        assert r1.finish_reason == "length" and r1.completion_ids == full[:4]
        msgs = msgs + [
            {"role": "assistant", "content": r1.message["content"]},
            {"role": "user", "content": "go on"},
        ]
        r2 = await turn(gw, "s", msgs)
        return r1, r2

    r1, r2 = asyncio.run(go())
    seg = backend.sessions["s"].segments[0]
    end = r1.prompt_len + 4
    assert len(backend.sessions["s"].segments) == 1
    assert seg.token_ids[r1.prompt_len : end] == full[:4]
    assert seg.token_ids[end] == r.close_token_id and seg.loss_mask[end] == 0
    assert gw.counters.retokenization_drift_total == 0 and r2.invariant_ok


def test_stop_string_cuts_completion_and_records_what_was_sampled(renderers):
    r = renderers["qwen3"]
    engine, backend, gw = make(r)
    comp = r.tokenizer.encode("alpha beta STOP gamma delta") + [r.close_token_id]
    engine.script("s", [comp])
    res = asyncio.run(turn(gw, "s", [{"role": "user", "content": "hi"}], stop=["STOP"]))
    assert res.finish_reason == "stop"
    assert res.message["content"] == "alpha beta "
    n = len(res.completion_ids)
    assert 0 < n < len(comp) and res.completion_ids == comp[:n]
    assert engine.sampled["s"] == [comp[:n]]
    assert backend.sessions["s"].segments[0].token_ids[res.prompt_len :] == comp[:n]


@pytest.mark.parametrize(
    "bad, code",
    [
        ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "unknown_tool_call_id"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "unsupported_content",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "prefill"}],
            "assistant_prefill_unsupported",
        ),
    ],
)
def test_bad_requests_record_nothing(renderers, bad, code):
    r = renderers["qwen3"]
    engine, backend, gw = make(r)
    engine.script("s", [tool_completion(r, '{"path":"a.py"}')])

    async def go():
        msgs = [{"role": "user", "content": "read"}]
        r1 = await turn(gw, "s", msgs)
        before = copy.deepcopy(backend.sessions["s"])
        call_msgs = msgs + [r1.message] + bad
        with pytest.raises(GatewayError) as ei:
            await turn(gw, "s", call_msgs)
        assert ei.value.status == 400 and ei.value.code == code
        assert backend.sessions["s"] == before
        with pytest.raises(GatewayError):
            await turn(gw, "fresh", bad)
        assert "fresh" not in backend.sessions

    asyncio.run(go())


def test_busy_backend_then_retry_reuses_recorded_prompt(renderers):
    r = renderers["deepseek-v3"]
    engine, backend, gw = make(r, backend_kw={"cells": ["c0"], "max_sessions_per_cell": 1})
    engine.script("a", [answer(r, "one")])
    engine.script("b", [answer(r, "two")])
    msgs = [{"role": "user", "content": "hello"}]

    async def go():
        await turn(gw, "a", msgs)
        with pytest.raises(BackendBusy):
            await turn(gw, "b", msgs)
        await backend.finish_session("a", 1.0, None)
        return await turn(gw, "b", msgs)

    res = asyncio.run(go())
    seg = backend.sessions["b"].segments
    assert len(seg) == 1
    assert seg[0].token_ids[: res.prompt_len] == r.render_ids(
        msgs, TOOLS, add_generation_prompt=True
    )
    assert len(seg[0].token_ids) == res.prompt_len + len(res.completion_ids)


def test_abandoned_turn_starts_a_segment_without_counting_a_rewrite(renderers):
    r = renderers["qwen3"]
    engine, backend, gw = make(r)
    engine.script("s", [answer(r, "first answer here"), answer(r, "second")])
    msgs = [{"role": "user", "content": "hi"}]

    async def go():
        async with gw.session_lock("s"):
            run = gw.start(await gw.plan("s", req(msgs)))
            agen = run.tokens()
            await agen.__anext__()  # the client goes away after one token
            await agen.aclose()
        return await turn(gw, "s", msgs)

    res = asyncio.run(go())
    segs = backend.sessions["s"].segments
    assert len(segs) == 2 and segs[1].reason == "untracked_buffer"
    assert sum(segs[0].loss_mask) == 1  # the one sampled token stays recorded
    assert gw.counters.history_rewrites_total == 0 and res.segment == 1


def test_prometheus_counters_registry():
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    c = PrometheusCounters(reg)
    c.history_rewrite()
    c.retokenization_drift(0)
    text = generate_latest(reg).decode()
    assert "history_rewrites_total 1.0" in text
    assert "retokenization_drift_total 0.0" in text


@pytest.mark.parametrize("name, rewrites", [("qwen3", 1), ("deepseek-v3", 0)])
def test_changed_tool_list_is_a_rewrite_only_where_rendered(renderers, name, rewrites):
    r = renderers[name]
    engine, backend, gw = make(r)
    engine.script("s", [answer(r, "one"), answer(r, "two")])
    more = TOOLS + [
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    ]

    async def go():
        msgs = [{"role": "user", "content": "hi"}]
        r1 = await turn(gw, "s", msgs)
        await turn(gw, "s", msgs + [r1.message, {"role": "user", "content": "more"}], tools=more)

    asyncio.run(go())
    assert gw.counters.history_rewrites_total == rewrites
    assert len(backend.sessions["s"].segments) == 1 + rewrites

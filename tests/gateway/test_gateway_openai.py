"""The gateway through the official openai client, over a real loopback HTTP server."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
from fastapi import FastAPI
from gateway_harness import load_corpus, next_messages, renderer_view
from prometheus_client import CollectorRegistry, generate_latest

from scheduler.gateway.router import make_chat_router
from scheduler.gateway.tito import InMemoryBackend, ReplayEngine
from scheduler.gateway.tito.memory import replay_logprob
from scheduler.gateway.tito.tito import naive_rerender_drift

PREFIX = {"qwen3": "/q", "deepseek-v3": "/d"}
SQL_TOOL = {
    "type": "function",
    "function": {
        "name": "run_sql",
        "description": "Run SQL.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "explain": {"type": "boolean"}},
        },
    },
}


class Env:
    def __init__(self, server, parts):
        self.server = server
        self.parts = parts

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.url}{PREFIX.get(name, name)}/v1", api_key="test", max_retries=0
        )


@pytest.fixture(scope="module")
def env(live_server_factory, renderers):
    app = FastAPI()
    parts = {}
    for name, prefix in PREFIX.items():
        engine = ReplayEngine()
        backend = InMemoryBackend(engine)
        registry = CollectorRegistry()
        router = make_chat_router(backend, name, registry=registry)
        app.include_router(router, prefix=prefix)
        parts[name] = (engine, backend, router.gateway, registry)
    small = InMemoryBackend(ReplayEngine())
    app.include_router(make_chat_router(small, "qwen3", max_body_bytes=4096), prefix="/small")
    parts["/small"] = (small.engine, small, None, None)
    busy = InMemoryBackend(ReplayEngine(), max_sessions_per_cell=0)
    app.include_router(make_chat_router(busy, "deepseek-v3"), prefix="/busy")
    parts["/busy"] = (busy.engine, busy, None, None)
    return Env(live_server_factory(app), parts)


def call(
    client: openai.OpenAI, sid: str, messages, tools, stream: bool, **kw
) -> tuple[dict, list[int], int]:
    """One turn; returns (assistant message dict, completion token ids, prompt tokens)."""
    hdr = {"X-Session-Id": sid}
    if not stream:
        resp = client.chat.completions.create(
            model="policy", messages=messages, tools=tools, extra_headers=hdr, **kw
        )
        ch = resp.choices[0]
        msg = ch.message.model_dump(exclude_none=True)
        msg = {k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")}
        msg.setdefault("content", None)
        assert len(ch.model_extra["token_logprobs"]) == len(ch.model_extra["token_ids"])
        assert resp.model_extra["session_id"] == sid
        return msg, ch.model_extra["token_ids"], resp.usage.prompt_tokens
    stream_it = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=tools,
        extra_headers=hdr,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    ids: list[int] = []
    content = ""
    calls: dict[int, dict] = {}
    usage = None
    finish = None
    for chunk in stream_it:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            ids += ch.model_extra["token_ids"]
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(
                    tc.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish in ("stop", "tool_calls", "length")
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, ids, usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_multi_turn_tool_sessions_record_exact_tokens(env, renderers, name, stream):
    engine, backend, gw, registry = env.parts[name]
    r = renderers[name]
    client = env.client(name)
    naive_total = 0
    # Sessions with parallel tool calls, a user follow-up, and harnesses that re-serialise
    # arguments (Python literals / other JSON spacing).
    chosen = load_corpus(name, [0, 1, 9] if name == "qwen3" else [1, 3, 6])
    assert any(len(t["expect_calls"]) > 1 for s in chosen for t in s["turns"])
    for s in chosen:
        sid = f"{s['id']}-{stream}"
        engine.script(sid, [t["completion_ids"] for t in s["turns"]])
        msgs = copy.deepcopy(s["messages"])
        prompts, naive_turns = [], []
        for t in s["turns"]:
            msg, ids, prompt_tokens = call(client, sid, msgs, s["tools"], stream)
            assert ids == t["completion_ids"]
            assert [c["function"]["name"] for c in msg.get("tool_calls") or []] == t["expect_calls"]
            prompts.append(prompt_tokens)
            naive_turns.append((renderer_view(msgs), ids))
            msgs = next_messages(msgs, msg, t, s["harness"])
        naive_turns.append((renderer_view(msgs), []))
        seg = backend.sessions[sid].segments
        assert len(seg) == 1
        toks, mask = seg[0].token_ids, seg[0].loss_mask
        sampled = engine.sampled[sid]
        # Bit for bit: the store's sampled tokens are the engine's own record.
        assert [x for x, m in zip(toks, mask, strict=False) if m] == [x for c in sampled for x in c]
        for k, p in enumerate(prompts):
            assert toks[p : p + len(sampled[k])] == sampled[k]
            if k + 1 < len(prompts):
                assert prompts[k + 1] > p + len(sampled[k])
        nd = naive_rerender_drift(r, naive_turns, s["tools"])
        assert nd > 0, f"naive loop reproduced {s['id']} exactly"
        naive_total += nd
    assert registry.get_sample_value("retokenization_drift_total") == 0
    assert registry.get_sample_value("history_rewrites_total") == 0
    assert "retokenization_drift_total 0.0" in generate_latest(registry).decode()
    assert gw.stats["bridge"] > 0


def test_rl_math_drift_examples_through_the_gateway(env, renderers):
    """'H'+'AVING', `false` -> `False`, compact JSON: exact in the gateway, drift in the naive loop."""
    engine, backend, gw, _ = env.parts["qwen3"]
    r = renderers["qwen3"]
    tok = r.tokenizer
    comp = (
        tok.encode(
            '<tool_call>\n{"name":"run_sql","arguments":{"query":"SELECT a FROM t GROUP BY a '
        )
        + [39, 83722]
        + tok.encode(' COUNT(*)>1","explain":false}}\n</tool_call><|im_end|>')
    )
    final = tok.encode("Done.<|im_end|>")
    engine.script("rlmath", [comp, final])
    client = env.client("qwen3")
    msgs = [{"role": "user", "content": "find duplicates"}]
    msg, ids, p0 = call(client, "rlmath", msgs, [SQL_TOOL], False)
    assert ids == comp
    args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
    assert args == {"query": "SELECT a FROM t GROUP BY a HAVING COUNT(*)>1", "explain": False}
    echo = copy.deepcopy(msg)
    echo["tool_calls"][0]["function"]["arguments"] = str(args)  # {'explain': False, ...}
    msgs2 = msgs + [
        echo,
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "\n3 rows"},
    ]
    _, ids2, p1 = call(client, "rlmath", msgs2, [SQL_TOOL], False)
    assert ids2 == final
    toks = backend.sessions["rlmath"].segments[0].token_ids
    assert toks[p0 : p0 + len(comp)] == comp and p1 > p0 + len(comp)
    assert naive_rerender_drift(r, [(msgs, comp), (renderer_view(msgs2), ids2)], [SQL_TOOL]) > 0
    naive = r.render_ids(renderer_view(msgs2), [SQL_TOOL], add_generation_prompt=True)
    assert naive[p0 : p0 + len(comp)] != comp


def test_logprobs_and_session_header(env, renderers):
    engine, backend, _, _ = env.parts["deepseek-v3"]
    r = renderers["deepseek-v3"]
    comp = r.tokenizer.encode("données ok") + [r.close_token_id]
    engine.script("lp", [comp])
    client = env.client("deepseek-v3")
    resp = client.chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        seed=7,
        extra_headers={"X-Session-Id": "lp"},
    )
    assert resp.headers["x-session-id"] == "lp"
    cc = resp.parse()
    ch = cc.choices[0]
    assert ch.model_extra["token_ids"] == comp
    lps = ch.model_extra["token_logprobs"]
    assert [e.logprob for e in ch.logprobs.content] == lps
    assert b"".join(bytes(e.bytes) for e in ch.logprobs.content[:-1]).decode() == "données ok"
    seg = backend.sessions["lp"].segments[0]
    assert seg.logprobs[-len(comp) :] == lps
    assert all(
        lp == replay_logprob(7, lp_req, i)
        for i, lp in enumerate(lps)
        for lp_req in [f"lp:{backend._req}"]
    )
    # Without X-Session-Id a fresh session id is minted and echoed.
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    assert raw.headers["x-session-id"].startswith("sess-")


def test_bad_input_is_4xx_with_error_object_and_records_nothing(env, renderers):
    engine, backend, _, _ = env.parts["qwen3"]
    client = env.client("qwen3")
    n_before = len(backend.sessions)
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        client.chat.completions.create(
            model="m", messages=[{"content": "no role"}], extra_headers={"X-Session-Id": "bad1"}
        )
    assert ei.value.status_code == 422 and ei.value.body["type"] == "invalid_request_error"
    assert ei.value.body["param"].startswith("messages[0]")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": "x"},
                {"role": "tool", "tool_call_id": "call_zzz", "content": "y"},
            ],
            extra_headers={"X-Session-Id": "bad2"},
        )
    assert (
        ei.value.body["code"] == "unknown_tool_call_id"
        and ei.value.body["param"] == "messages[1].tool_call_id"
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            n=2,
            extra_headers={"X-Session-Id": "bad3"},
        )
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Session-Id": "bad id!"},
        )
    assert ei.value.body["code"] == "invalid_session_id"
    r = httpx.post(
        f"{env.server.url}/q/v1/chat/completions",
        content=b"{not json",
        headers={"X-Session-Id": "bad4"},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_json"
    assert len(backend.sessions) == n_before
    # Oversized body.
    small = env.parts["/small"][1]
    big = openai.OpenAI(base_url=f"{env.server.url}/small/v1", api_key="t", max_retries=0)
    with pytest.raises(openai.APIStatusError) as ei:
        big.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x" * 20000}],
            extra_headers={"X-Session-Id": "big"},
        )
    assert ei.value.status_code == 413 and ei.value.body["code"] == "body_too_large"
    assert small.sessions == {}


def test_finish_sticky_cells_migration_and_busy(env, renderers):
    engine, backend, _, _ = env.parts["deepseek-v3"]
    r = renderers["deepseek-v3"]
    client = env.client("deepseek-v3")
    engine.script("st", [r.tokenizer.encode(f"reply {i}") + [r.close_token_id] for i in range(4)])
    msgs = [{"role": "user", "content": "turn 0"}]
    for i in range(4):
        msg, _, _ = call(client, "st", msgs, None, False)
        msgs = msgs + [msg, {"role": "user", "content": f"turn {i + 1}"}]
        if i == 1:
            before = backend.cell_of("st")
            other = next(c for c in backend.cells if c != before)
            backend.migrate("st", other)
    log = [e for e in backend.turn_log if e["session"] == "st"]
    cells = [e["cell"] for e in log]
    assert cells[0] == cells[1] != cells[2] == cells[3]
    # KV reuse across turns: each later turn reuses the whole previous buffer, also after the move.
    for k in range(1, 4):
        assert log[k]["reused_tokens"] > 0 and log[k]["reused_tokens"] < log[k]["prompt_tokens"]
    url = f"{env.server.url}/d/v1/sessions/st/finish"
    fin = httpx.post(url, json={"reward": 1.0, "group_id": "g1"})
    assert fin.status_code == 200 and fin.json()["reward"] == 1.0
    assert httpx.post(url, json={"reward": 1.0}).status_code == 409
    assert httpx.post(f"{env.server.url}/d/v1/sessions/nope/finish", json={}).status_code == 404
    with pytest.raises(openai.ConflictError):
        call(client, "st", msgs, None, False)
    # No capacity: 429 with Retry-After, nothing recorded.
    busy = env.parts["/busy"][1]
    bc = openai.OpenAI(base_url=f"{env.server.url}/busy/v1", api_key="t", max_retries=0)
    with pytest.raises(openai.RateLimitError) as ei:
        bc.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Session-Id": "b1"},
        )
    assert ei.value.response.headers["retry-after"] == "1"
    assert busy.sessions["b1"].segments[0].loss_mask == [0] * len(
        busy.sessions["b1"].segments[0].loss_mask
    )


def test_stream_refusals_keep_status_and_abandoned_stream_frees_session(env, renderers):
    bc = openai.OpenAI(base_url=f"{env.server.url}/busy/v1", api_key="t", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        bc.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            extra_headers={"X-Session-Id": "b2"},
        )
    engine, backend, _, _ = env.parts["qwen3"]
    r = renderers["qwen3"]
    engine.script(
        "ab",
        [
            r.tokenizer.encode("word " * 300) + [r.close_token_id],
            r.tokenizer.encode("ok<|im_end|>"),
        ],
    )
    client = env.client("qwen3")
    msgs = [{"role": "user", "content": "talk"}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m",
            messages=msgs + [{"role": "tool", "tool_call_id": "x", "content": "y"}],
            stream=True,
            extra_headers={"X-Session-Id": "ab"},
        )
    stream = client.chat.completions.create(
        model="m", messages=msgs, stream=True, extra_headers={"X-Session-Id": "ab"}
    )
    next(iter(stream))
    stream.close()  # the harness goes away mid-completion
    # The session is not left locked: the retry runs (in a new segment, nothing lost).
    quick = openai.OpenAI(base_url=f"{env.server.url}/q/v1", api_key="t", max_retries=0, timeout=10)
    resp = quick.chat.completions.create(
        model="m", messages=msgs, extra_headers={"X-Session-Id": "ab"}
    )
    assert resp.choices[0].message.content == "ok"
    segs = backend.sessions["ab"].segments
    assert len(segs) == 2 and sum(segs[0].loss_mask) >= 1
    assert (
        segs[1].token_ids[-len(resp.choices[0].model_extra["token_ids"]) :]
        == resp.choices[0].model_extra["token_ids"]
    )

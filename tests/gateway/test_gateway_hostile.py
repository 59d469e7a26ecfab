"""Hostile and odd input at the gateway: each is a clear 4xx or an accepted turn, never a 500,
and nothing is recorded for a refused turn."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest
from fastapi import FastAPI

from scheduler.gateway.router import make_chat_router
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine
from tests.gateway.test_gateway_tito import TOOLS, answer, make, tool_completion, turn


def _tool_text(renderer, name_json: str, args: str) -> list[int]:
    tok = renderer.tokenizer
    return tok.encode(f'<tool_call>\n{{"name":{name_json},"arguments":{args}}}\n</tool_call>') + [
        renderer.close_token_id]


def test_javascript_style_numbers_in_echoed_arguments_are_not_a_rewrite(renderers):
    r = renderers["qwen3"]
    engine, backend, gw = make(r)
    engine.script("s", [tool_completion(r, '{"path":"a.py","n":1.0,"m":1e3,"x":[2.50]}'), answer(r, "ok")])

    async def go():
        msgs = [{"role": "user", "content": "read"}]
        r1 = await turn(gw, "s", msgs)
        echo = copy.deepcopy(r1.message)
        # what JSON.stringify(JSON.parse(args)) gives in a JavaScript harness
        echo["tool_calls"][0]["function"]["arguments"] = '{"path":"a.py","n":1,"m":1000,"x":[2.5]}'
        tid = echo["tool_calls"][0]["id"]
        await turn(gw, "s", msgs + [echo, {"role": "tool", "tool_call_id": tid, "content": "x"}])

    asyncio.run(go())
    assert gw.counters.history_rewrites_total == 0
    assert len(backend.sessions["s"].segments) == 1


@pytest.mark.parametrize("name_json", ["5", "null", '{"a": 1}', '["read_file"]', '""'])
def test_a_sampled_non_string_tool_name_is_no_call_and_its_echo_is_accepted(renderers, name_json):
    from scheduler.gateway.tito.openai_schema import ResponseMessage

    r = renderers["qwen3"]
    engine, backend, gw = make(r)
    engine.script("s", [_tool_text(r, name_json, "{}"), answer(r, "ok")])

    async def go():
        msgs = [{"role": "user", "content": "read"}]
        r1 = await turn(gw, "s", msgs)
        assert "tool_calls" not in r1.message and isinstance(r1.message["content"], str)
        ResponseMessage.model_validate(r1.message)  # the response the harness gets is valid
        await turn(gw, "s", msgs + [copy.deepcopy(r1.message), {"role": "user", "content": "again"}])

    asyncio.run(go())
    assert gw.counters.history_rewrites_total == 0


@pytest.fixture(scope="module")
def gateway_url(live_server_factory):
    engine = ReplayEngine()
    app = FastAPI()
    app.include_router(make_chat_router(InMemoryBackend(engine), "qwen3"))
    server = live_server_factory(app)
    return server.url, engine


def _deep(n: int) -> str:
    """A JSON schema nested `n` objects deep, as text (json.dumps itself stops near 1,000)."""
    return '{"type":"object","properties":{"x":' * n + '{"type":"string"}' + "}}" * n


@pytest.mark.parametrize("n", [100, 950, 5000])
def test_deeply_nested_tool_schema_is_a_400(gateway_url, n):
    url, _ = gateway_url
    body = ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            f'"function": {{"name": "f", "parameters": {_deep(n)}}}}}]}}')
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"X-Session-Id": f"deep{n}",
                                                                         "content-type": "application/json"})
    assert r.status_code in (400, 422), r.text[:200]
    assert r.json()["error"]["code"] in ("too_deep", "invalid_json")


@pytest.mark.parametrize("field", ["model", "content", "tool_name", "user"])
def test_lone_surrogate_anywhere_is_a_400(gateway_url, field):
    url, _ = gateway_url
    body = {"messages": [{"role": "user", "content": "hi"}], "model": "m", "tools": TOOLS}
    if field == "model":
        body["model"] = "\ud800"
    elif field == "content":
        body["messages"][0]["content"] = "a\udfffb"
    elif field == "tool_name":
        body["tools"] = [{"type": "function", "function": {"name": "f\ud800", "parameters": {}}}]
    else:
        body["user"] = "\ud800x"
    for stream in (False, True):
        raw = json.dumps({**body, "stream": stream})  # ensure_ascii: the surrogate travels as \\ud800
        r = httpx.post(f"{url}/v1/chat/completions", content=raw,
                       headers={"X-Session-Id": f"sur-{field}-{stream}", "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text", r.text[:300]


def test_a_prompt_past_the_default_limit_is_a_clear_400(renderers):
    r = renderers["qwen3"]
    engine, backend, gw = make(r, max_prompt_tokens=65536)
    from scheduler.gateway.tito.tito import GatewayError

    async def go():
        with pytest.raises(GatewayError) as ei:
            await turn(gw, "s", [{"role": "user", "content": "word " * 70_000}])
        assert ei.value.status == 400 and ei.value.code == "context_length_exceeded"
        assert "65536" in ei.value.message

    asyncio.run(go())
    assert "s" not in backend.sessions


def test_the_router_applies_the_prompt_limit_by_default():
    from scheduler.contract.config.gateway import DEFAULT_MAX_PROMPT_TOKENS, GatewayConfig

    assert GatewayConfig().max_prompt_tokens == DEFAULT_MAX_PROMPT_TOKENS == 65536

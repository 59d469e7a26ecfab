"""Renderer presets: bridge vs two-render difference, parsing of parallel tool calls."""

from __future__ import annotations

import pytest

from scheduler.gateway.tito.render import RENDERER_PRESETS, load_renderer

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


def _completion(r, calls: list[str]) -> list[int]:
    tok = r.tokenizer
    if r.name.startswith("qwen3"):
        text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) + "<|im_end|>"
        return tok.encode(text)
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{c}\n```<｜tool▁call▁end｜>"
        for c in calls
    )
    return tok.encode(f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")


def _args(r, path: str, flag: str = "false") -> str:
    if r.name.startswith("qwen3"):
        return f'{{"name":"read_file","arguments":{{"path":"{path}","flag":{flag}}}}}'
    return f'{{"path":"{path}","flag":{flag}}}'


@pytest.mark.parametrize("name", list(RENDERER_PRESETS))
@pytest.mark.parametrize(
    "new",
    [
        [{"role": "tool", "tool_call_id": "a", "content": "\nfirst line"}],
        [
            {"role": "tool", "tool_call_id": "a", "content": "one"},
            {"role": "tool", "tool_call_id": "b", "content": '{"ok": true}'},
        ],
        [
            {"role": "tool", "tool_call_id": "a", "content": "one"},
            {"role": "user", "content": "Also check HAVING."},
        ],
        [{"role": "user", "content": "next question"}],
    ],
    ids=["one_tool", "parallel_tools", "tool_then_user", "user"],
)
def test_render_diff_equals_bridge_extension(name, new):
    r = load_renderer(name)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "read a.py and b.py"}]
    prompt = r.render_ids(msgs, TOOLS, add_generation_prompt=True)
    comp = _completion(r, [_args(r, "a.py"), _args(r, "b.py", "true")])
    bridged = r.bridge(prompt, comp, new, TOOLS)
    assert bridged is not None and bridged[: len(prompt) + len(comp)] == prompt + comp
    assert bridged[len(prompt) + len(comp) :] == r.render_diff(new, TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_parse_parallel_noncanonical_tool_calls(name):
    r = load_renderer(name)
    comp = _completion(r, [_args(r, "a.py"), _args(r, "数据.md", "null")])
    parsed = r.parse_response(comp, TOOLS, None)
    assert [(tc.name, tc.arguments) for tc in parsed.tool_calls] == [
        ("read_file", {"path": "a.py", "flag": False}),
        ("read_file", {"path": "数据.md", "flag": None}),
    ]
    assert all(tc.status.value == "ok" for tc in parsed.tool_calls)


def test_presets_and_aliases():
    assert load_renderer("qwen") is load_renderer("qwen3")
    assert load_renderer("deepseek").tokenizer.name == "deepseek-v3"
    assert load_renderer("qwen3").stop_token_ids == (151645, 151643)
    assert load_renderer("deepseek-v3").stop_token_ids == (1,)
    with pytest.raises(ValueError):
        load_renderer("nope")

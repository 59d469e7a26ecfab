"""Offline tokenizers: the full Qwen3 / DeepSeek-V3 vocabularies and the drift examples."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler.gateway.tito.tokenizers import QWEN3_ADDED_TOKENS, load_tokenizer


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer("deepseek-v3")


def test_qwen3_added_tokens_follow_endoftext_in_published_order(qwen):
    assert qwen.convert_tokens_to_ids("<|endoftext|>") == 151643
    assert qwen.convert_tokens_to_ids("<|im_start|>") == 151644
    assert qwen.convert_tokens_to_ids("<|im_end|>") == 151645
    assert qwen.convert_tokens_to_ids("<tool_call>") == 151657
    assert qwen.convert_tokens_to_ids("</tool_call>") == 151658
    assert qwen.convert_tokens_to_ids("<tool_response>") == 151665
    assert qwen.convert_tokens_to_ids("<think>") == 151667
    assert qwen.convert_tokens_to_ids("</think>") == 151668
    assert [qwen.convert_tokens_to_ids(t) for t in QWEN3_ADDED_TOKENS] == list(
        range(151643, 151669)
    )
    assert qwen.vocab_size == 151669
    assert qwen.eos_token_id == 151645 and qwen.unk_token_id is None
    # Added tokens written in text are recognised, as the renderers need.
    assert qwen.encode("<think>\n\n</think>\n\n") == [151667, 271, 151668, 271]
    assert qwen.decode([151657, 198]) == "<tool_call>\n"
    # <tool_call>/<think> are not "special" for skip_special_tokens; <|im_end|> is.
    assert qwen.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"


def test_qwen3_retokenization_examples(qwen):
    # Sampled [39 'H', 83722 'AVING'] decodes to "HAVING" but re-encodes differently.
    assert qwen.decode([39, 83722]) == "HAVING"
    assert qwen.encode("HAVING") == [72239, 1718]
    assert qwen.encode(" false") == [895] and qwen.encode(" False") == [3557]
    assert len(qwen.encode('{"path":"a.py","line":3}')) == 10
    assert len(qwen.encode('{"path": "a.py", "line": 3}')) == 13
    assert qwen.encode("\n") == [198] and qwen.encode("\n\n") == [271]
    assert qwen.convert_tokens_to_ids("Ġfalse") == 895
    assert qwen.convert_ids_to_tokens(895) == "Ġfalse"
    assert qwen.token_bytes(895) == b" false"
    assert qwen.convert_tokens_to_ids("<nope>") is None


def test_deepseek_v3_vocabulary(deepseek):
    assert deepseek.vocab_size == 129280
    assert deepseek.eos_token_id == 1 and deepseek.bos_token_id == 0
    ids = deepseek.encode("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f")
    assert ids[:2] == [128806, 128808] and ids[3] == 128814
    text = 'x\n```json\n{"a": false, "b": "données 数据"}\n```'
    assert deepseek.decode(deepseek.encode(text)) == text
    assert deepseek.token_bytes(deepseek.encode(" false")[0]) == b" false"


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError):
        load_tokenizer("gpt-17")


def test_offline_and_free_of_torch_and_cells():
    """Vocabularies come from the installed packages: no socket is opened, no torch loaded (nor
    FastAPI by the TITO logic)."""
    code = textwrap.dedent(
        """
        import socket, sys
        def refuse(*a, **k):
            raise OSError("network access attempted")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        from scheduler.gateway.tito.render import load_renderer
        for name in ("qwen3", "deepseek-v3"):
            r = load_renderer(name)
            ids = r.render_ids([{"role": "user", "content": "hi"}], None, add_generation_prompt=True)
            assert r.tokenizer.decode(ids)
        import scheduler.gateway.tito
        assert "fastapi" not in sys.modules, "the TITO logic (the toy task runs it) pulls in the HTTP side"
        import scheduler.gateway.router
        assert "torch" not in sys.modules and "cells" not in sys.modules
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr

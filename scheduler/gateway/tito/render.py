"""Chat templates and tool-call parsing through the ``renderers`` package.

A renderer is selected by name from :data:`RENDERER_PRESETS`; each preset pairs one offline
tokenizer (:mod:`scheduler.gateway.tito.tokenizers`) with an explicit ``renderers`` config, so no
model-name lookup (and no network) is involved:

=================  ============  ==========================================================
name               tokenizer     renderer config
=================  ============  ==========================================================
``qwen3``          qwen3         ``Qwen3RendererConfig(thinking_retention="all")``
``qwen3-nothink``  qwen3         ``Qwen3RendererConfig(enable_thinking=False, ...="all")``
``deepseek-v3``    deepseek-v3   ``DeepSeekV3RendererConfig()``
=================  ============  ==========================================================

``thinking_retention="all"`` lets ``bridge_to_next_turn`` extend a session across user-query
boundaries: the gateway never re-renders sampled history, so the template's habit of dropping
old reasoning must not force a re-render. ``qwen`` and ``deepseek`` are accepted as aliases.

:class:`ChatRenderer` adds the one operation the package lacks, :meth:`ChatRenderer.render_diff`:
the token difference of two renders (with and without a turn's new messages, all of them
together, over the same dummy prefix), used when the bridge cannot prove its contract.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from scheduler.gateway.tito.tokenizers import ChatTokenizer, load_tokenizer, untrusted_text

__all__ = [
    "ChatRenderer",
    "RENDERER_PRESETS",
    "RendererPreset",
    "RenderDiffError",
    "load_renderer",
]


class RenderDiffError(ValueError):
    """No dummy prefix gave a render difference whose shorter render is a prefix."""


@dataclass(frozen=True)
class RendererPreset:
    """One selectable chat format: a tokenizer name and a ``renderers`` config factory."""

    tokenizer: str
    config_name: str
    config_kwargs: tuple[tuple[str, Any], ...] = ()

    def make_config(self) -> Any:
        import renderers

        cls = {
            "qwen3": renderers.Qwen3RendererConfig,
            "deepseek-v3": renderers.DeepSeekV3RendererConfig,
        }[self.config_name]
        return cls(**dict(self.config_kwargs))


RENDERER_PRESETS: dict[str, RendererPreset] = {
    "qwen3": RendererPreset("qwen3", "qwen3", (("thinking_retention", "all"),)),
    "qwen3-nothink": RendererPreset(
        "qwen3", "qwen3", (("enable_thinking", False), ("thinking_retention", "all"))
    ),
    "deepseek-v3": RendererPreset("deepseek-v3", "deepseek-v3", (("thinking_retention", "all"),)),
}
_ALIASES = {"qwen": "qwen3", "deepseek": "deepseek-v3"}

# Dummy conversation the render differences start from.
BRIDGE_WINDOW = 4096
"""How far back from the previous prompt's end :meth:`ChatRenderer.bridge_extension` looks for
its last turn-closing token."""

_DUMMY_USER = {"role": "user", "content": "x"}
_DUMMY_ASSISTANT = {"role": "assistant", "content": "y", "reasoning_content": "r"}


class ChatRenderer:
    """A tokenizer plus a ``renderers`` renderer, with the operations the gateway needs."""

    def __init__(self, name: str, tokenizer: ChatTokenizer, renderer: Any) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.stop_token_ids: tuple[int, ...] = tuple(renderer.get_stop_token_ids())
        self.close_token_id: int = self.stop_token_ids[0]
        """Canonical turn close appended (loss mask 0) after a truncated completion."""
        self._stop_set = frozenset(self.stop_token_ids)
        self._separator: list[int] | None = None
        self._renders_tools: bool | None = None

    # -- thin wrappers -------------------------------------------------------------------
    def render_ids(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool
    ) -> list[int]:
        with untrusted_text(self.tokenizer, message_texts(messages)):
            return list(
                self.renderer.render_ids(
                    messages, tools=tools or None, add_generation_prompt=add_generation_prompt
                )
            )

    def parse_response(
        self, completion_ids: list[int], tools: list[dict] | None, prompt_ids: list[int] | None
    ) -> Any:
        return self.renderer.parse_response(
            completion_ids, tools=tools or None, prompt_ids=prompt_ids
        )

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: list[dict],
        tools: list[dict] | None,
    ) -> list[int] | None:
        """``bridge_to_next_turn`` token ids, or None when the renderer declines."""
        with untrusted_text(self.tokenizer, message_texts(new_messages)):
            out = self.renderer.bridge_to_next_turn(
                prev_prompt_ids, prev_completion_ids, new_messages, tools=tools or None
            )
        return None if out is None else list(out.token_ids)

    def bridge_extension(
        self, prev: list[int], prompt_end: int, new_messages: list[dict], tools: list[dict] | None
    ) -> list[int] | None:
        """The tokens :meth:`bridge` appends to ``prev`` (the previous prompt ``prev[:prompt_end]``
        and its completion), or None when it declines or would not keep ``prev`` whole.

        The renderers read the previous prompt only after its last turn-closing token (where a
        reasoning block may still be open) and copy the rest: the bridge is given the prompt
        from that token on (searched within ``BRIDGE_WINDOW`` tokens; the whole prompt when
        none is there), so a 128k-token context costs a turn no copies of itself."""
        cut = self._last_close(prev, prompt_end)
        window = prev[cut:]
        b = self.bridge(window[: prompt_end - cut], window[prompt_end - cut :], new_messages, tools)
        if b is None or len(b) <= len(window) or b[: len(window)] != window:
            return None
        return b[len(window) :]

    def _last_close(self, ids: list[int], end: int) -> int:
        """Index of the last turn-closing token in ``ids[:end]`` within ``BRIDGE_WINDOW`` of
        ``end`` (0 when there is none)."""
        for i in range(end - 1, max(0, end - BRIDGE_WINDOW) - 1, -1):
            if ids[i] in self._stop_set:
                return i
        return 0

    @property
    def renders_tools(self) -> bool:
        """Whether the tool list reaches the prompt (DeepSeek-V3's template ignores it)."""
        if self._renders_tools is None:
            probe = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
            self._renders_tools = self.render_ids(
                [_DUMMY_USER], probe, add_generation_prompt=True
            ) != self.render_ids([_DUMMY_USER], None, add_generation_prompt=True)
        return self._renders_tools

    # -- render difference ---------------------------------------------------------------
    def ends_turn(self, completion_ids: list[int]) -> bool:
        return bool(completion_ids) and completion_ids[-1] in self._stop_set

    def _turn_separator(self) -> list[int]:
        """Template tokens between an assistant's closing token and the next message."""
        if self._separator is None:
            ids = self.render_ids(
                [_DUMMY_USER, {"role": "assistant", "content": "y"}], add_generation_prompt=False
            )
            last = max(i for i, t in enumerate(ids) if t in self._stop_set)
            self._separator = ids[last + 1 :]
        return list(self._separator)

    def render_diff(self, new_messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Tokens that follow a closed assistant turn when ``new_messages`` come next.

        All of the turn's new messages are diffed together (the Qwen3 template merges
        consecutive tool messages into one block). Two dummy prefixes are tried: one ending
        in an assistant turn (the difference starts right after its closing token), and one
        ending in a user turn plus the template's inter-turn separator (for templates whose
        rendering of an earlier assistant depends on what follows). The shorter render must
        be a prefix of the longer one, else :class:`RenderDiffError`.
        """
        tools = tools or None
        # Prefix ending in an assistant turn.
        base = [_DUMMY_USER, _DUMMY_ASSISTANT]
        r0 = self.render_ids(base, tools, add_generation_prompt=False)
        r1 = self.render_ids(base + new_messages, tools, add_generation_prompt=True)
        if r1[: len(r0)] == r0:
            stops = [i for i, t in enumerate(r0) if t in self._stop_set]
            if stops:
                return r1[stops[-1] + 1 :]
        # Prefix ending in a user turn, plus the separator after an assistant close.
        base = [_DUMMY_USER]
        r0 = self.render_ids(base, tools, add_generation_prompt=False)
        r1 = self.render_ids(base + new_messages, tools, add_generation_prompt=True)
        if r1[: len(r0)] == r0:
            return self._turn_separator() + r1[len(r0) :]
        raise RenderDiffError("the shorter render is not a prefix of the longer one")


@cache
def _load(name: str) -> ChatRenderer:
    import renderers

    preset = RENDERER_PRESETS[name]
    tok = load_tokenizer(preset.tokenizer)
    return ChatRenderer(name, tok, renderers.create_renderer(tok, preset.make_config()))


def load_renderer(name: str) -> ChatRenderer:
    """The renderer preset called ``name`` (built once per process); ``ValueError`` if unknown."""
    key = _ALIASES.get(name, name)
    if key not in RENDERER_PRESETS:
        raise ValueError(f"unknown renderer {name!r}; known: {', '.join(RENDERER_PRESETS)}")
    return _load(key)


def message_texts(messages: list[dict]) -> Iterator[str]:
    """Every text a client wrote into `messages`: contents (strings or text parts), reasoning,
    tool-call names and arguments. Rendered, a special token's string in them stays text."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]
        for key in ("reasoning_content", "name"):
            if isinstance(m.get(key), str):
                yield m[key]
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                for key in ("name", "arguments"):
                    v = fn.get(key)
                    if isinstance(v, str):
                        yield v
                    elif v is not None:
                        yield json.dumps(v, ensure_ascii=False)

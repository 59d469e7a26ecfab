"""What a chat request asks for, validated: renderer messages, tools and sampling params.

Pure functions of the request (no session, no store): a request they refuse raises
:class:`GatewayError` before anything is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from scheduler.contract.sampling import SamplingParams, describe
from scheduler.gateway.tito.errors import GatewayError
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest

__all__ = ["convert_messages", "request_tools", "sampling_params"]


def text_content(content: Any, where: str) -> str:
    """A message's content as text; only text parts are accepted."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content):
        if getattr(p, "type", None) != "text" or not hasattr(p, "text"):
            raise GatewayError(
                400,
                f"content part of type {getattr(p, 'type', '?')!r} is not supported; only text parts are",
                param=f"{where}.content[{j}]",
                code="unsupported_content",
            )
        parts.append(p.text)
    return "".join(parts)


def convert_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> renderer messages, validating their structure.

    A tool message must answer a call of the assistant message before it, once; tool-call
    ids are unique across the conversation; the last message is not an assistant's.
    """
    out: list[dict[str, Any]] = []
    open_calls: set[str] | None = None  # ids of the latest assistant's unanswered calls
    all_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("system", "developer", "user"):
            role = "user" if m.role == "user" else "system"
            out.append({"role": role, "content": text_content(m.content, where)})
            open_calls = None
        elif m.role == "assistant":
            msg, open_calls = _assistant_message(m, where, all_ids)
            all_ids |= open_calls
            out.append(msg)
        else:
            out.append(_tool_message(m, where, open_calls))
    if out[-1]["role"] == "assistant":
        raise GatewayError(
            400,
            "the last message must not be an assistant message (continuing a prefilled "
            "assistant turn is not supported)",
            param=f"messages[{len(out) - 1}]",
            code="assistant_prefill_unsupported",
        )
    return out


def _assistant_message(m: Any, where: str, seen: set[str]) -> tuple[dict[str, Any], set[str]]:
    """The renderer form of an assistant message and the ids of its tool calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": text_content(m.content, where)}
    if m.reasoning_content:
        msg["reasoning_content"] = m.reasoning_content
    ids: set[str] = set()
    if m.tool_calls:
        calls = []
        for j, tc in enumerate(m.tool_calls):
            if tc.id in ids or tc.id in seen:
                raise GatewayError(
                    400,
                    f"tool call id {tc.id!r} is used more than once",
                    param=f"{where}.tool_calls[{j}].id",
                    code="duplicate_tool_call_id",
                )
            ids.add(tc.id)
            calls.append(
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
            )
        msg["tool_calls"] = calls
    return msg, ids


def _tool_message(m: Any, where: str, open_calls: set[str] | None) -> dict[str, Any]:
    """The renderer form of a tool message; consumes the call it answers from ``open_calls``."""
    if open_calls is None or m.tool_call_id not in open_calls:
        raise GatewayError(
            400,
            f"tool message refers to unknown tool call id {m.tool_call_id!r} (it must answer "
            "a tool call of the assistant message before it, once)",
            param=f"{where}.tool_call_id",
            code="unknown_tool_call_id",
        )
    open_calls.discard(m.tool_call_id)
    return {
        "role": "tool",
        "tool_call_id": m.tool_call_id,
        "content": text_content(m.content, where),
    }


def request_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools (unique names; ``tool_choice`` naming one of them), or None."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise GatewayError(
                400, "tool_choice needs tools", param="tool_choice", code="invalid_tool_choice"
            )
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise GatewayError(
            400, "tool names must be unique", param="tools", code="duplicate_tool_name"
        )
    tc = req.tool_choice
    if tc is not None and not isinstance(tc, str) and tc.function.name not in names:
        raise GatewayError(
            400,
            f"tool_choice names unknown tool {tc.function.name!r}",
            param="tool_choice",
            code="invalid_tool_choice",
        )
    return tools


def sampling_params(
    req: ChatCompletionRequest,
    stop_token_ids: Sequence[int],
    vocab_size: int,
    default_max_tokens: int | None,
) -> SamplingParams:
    """The backend's sampling params: the request's fields of `SamplingParams` that it set (a
    `top_k` of -1 is OpenAI's "off"), `max_completion_tokens` before `max_tokens` before the
    gateway's default, and the renderer's stop tokens plus the request's."""
    if req.n not in (None, 1):
        raise GatewayError(400, "only n=1 is supported", param="n", code="unsupported_value")
    stop_ids = list(stop_token_ids)
    for j, t in enumerate(req.stop_token_ids or ()):
        if not 0 <= t < vocab_size:
            raise GatewayError(
                400,
                f"stop token id {t} is outside the vocabulary",
                param=f"stop_token_ids[{j}]",
            )
        if t not in stop_ids:
            stop_ids.append(t)
    given = {k: v for k in SamplingParams.model_fields if (v := getattr(req, k, None)) is not None}
    given.update(stop_token_ids=stop_ids, max_tokens=req.max_completion_tokens or req.max_tokens or default_max_tokens)
    if given.get("top_k") == -1:
        del given["top_k"]
    try:
        return SamplingParams.model_validate({k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        field = str(e.errors()[0]["loc"][0])
        status, code = (422, "invalid_seed") if field == "seed" else (400, "invalid_value")
        raise GatewayError(status, f"invalid sampling params: {describe(e)}", param=field, code=code) from None

"""Fingerprints of recorded conversations: what a message or a tool list means, as a digest.

The gateway compares a request's messages with the conversation it recorded by these
digests, never by re-rendering: assistant turns by content and by tool-call id, name and
*parsed* arguments, so a harness that re-serialises arguments with other spacing or as
Python literals still matches.
"""

from __future__ import annotations

import ast
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["FingerprintCache", "canonical_arguments", "message_fingerprint", "tools_key"]


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments in one canonical JSON form (sorted keys, compact).

    Accepts an object, JSON text with any spacing, or Python-literal text (``False``,
    ``None``, single quotes) as some harnesses re-serialise it; anything else is kept as
    stripped text. Numbers compare by value, as JSON means them (``1.0``, ``1`` and ``1e0``
    are one number, as a JavaScript harness re-serialises them).
    """
    obj: Any
    if isinstance(arguments, str):
        text = arguments.strip()
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = text
            if len(text) <= 1_000_000:
                try:
                    obj = ast.literal_eval(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    obj = text
    else:
        obj = arguments
    try:
        return json.dumps(_numbers_by_value(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return json.dumps(str(obj))


def _numbers_by_value(obj: Any, depth: int = 0) -> Any:
    """Integral floats as ints (below 2**53, where both are exact), recursively."""
    if depth > 200:
        raise RecursionError("arguments nested too deeply")
    if isinstance(obj, float) and obj.is_integer() and abs(obj) < 2**53:
        return int(obj)
    if isinstance(obj, dict):
        return {k: _numbers_by_value(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_numbers_by_value(v, depth + 1) for v in obj]
    return obj


def message_fingerprint(msg: dict[str, Any]) -> str:
    """A digest of what a (renderer-form) message means for the conversation."""
    role = msg["role"]
    if role == "assistant":
        calls = [
            [
                tc.get("id"),
                tc["function"]["name"],
                canonical_arguments(tc["function"].get("arguments", {})),
            ]
            for tc in msg.get("tool_calls") or ()
        ]
        key: list[Any] = ["assistant", (msg.get("content") or "").strip(), calls]
    elif role == "tool":
        key = ["tool", msg.get("tool_call_id"), msg.get("content") or ""]
    else:
        key = [role, msg.get("content") or ""]
    raw = json.dumps(key, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def tools_key(tools: list[dict] | None) -> str:
    """A digest of a tool list ("" for none)."""
    if not tools:
        return ""
    raw = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


class FingerprintCache:
    """`message_fingerprint` remembered for the messages a harness resends every turn.

    A user, system or tool message with text content is looked up by (role, tool call id,
    text): the lookup hashes and compares the text at C speed, where its JSON digest costs
    ~10 ms for a 500 KB message. Assistant messages (short, with parsed tool calls) are
    fingerprinted each time. Bounded by `max_chars` of remembered text, oldest first out.
    Plans are composed on worker threads: one lock around the bookkeeping."""

    def __init__(self, max_chars: int = 1 << 26) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self.kept: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, msg: dict[str, Any]) -> str:
        content = msg.get("content") or ""
        if msg["role"] == "assistant" or not isinstance(content, str):
            return message_fingerprint(msg)
        key = (msg["role"], msg.get("tool_call_id") if msg["role"] == "tool" else None, content)
        with self._lock:
            fp = self.kept.get(key)
            if fp is not None:
                self.kept.move_to_end(key)
                return fp
        fp = message_fingerprint(msg)
        with self._lock:
            if key not in self.kept:
                self.kept[key] = fp
                self.chars += len(content)
            while self.chars > self.max_chars and len(self.kept) > 1:
                old, _ = self.kept.popitem(last=False)
                self.chars -= len(old[2])
        return fp

"""Checks on decoded JSON that its parser lets through: lone UTF-16 surrogates (`"\\ud800"`
decodes to a str that cannot be encoded, so it fails later — in an error message, in SQLite)
and nesting deep enough to exhaust recursion in code that walks it. Both walks are iterative.
And the way out: `dumps` / `SafeJSONResponse`, strict JSON whatever floats an answer holds."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.responses import JSONResponse

MAX_DEPTH = 64
"""Deepest JSON nesting a request may carry (a chat request with tool schemas needs ~20)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def may_hold_surrogate(raw: bytes) -> bool:
    """Cheap pre-check on the raw body: only bodies with a surrogate escape need the walk (and
    only bodies with an escape at all need the pattern: a memchr-speed scan first)."""
    return b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, list):
        return node
    return []


def lone_surrogate_path(doc: Any) -> str | None:
    """Where the first string (key or value) with a lone surrogate is, or None."""
    stack: list[tuple[Any, str]] = [(doc, "body")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(node, dict):
            stack.extend((k, f"{where} key") for k in node)
            stack.extend((v, f"{where}.{k}" if isinstance(k, str) and k.isprintable() else where)
                         for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return None


def depth(doc: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of `doc`, counting stops once past `limit` (returns limit + 1)."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return limit + 1
        stack.extend((c, d + 1) for c in _children(node) if isinstance(c, (dict, list)))
    return deepest


def finite(doc: Any) -> Any:
    """`doc` with every non-finite float (NaN, ±Infinity) replaced by None: strict JSON can carry
    it, so no value — a log-prob, a metric, a record from an older store — fails an answer."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [finite(v) for v in doc]
    return doc


def dumps(doc: Any, **kw: Any) -> str:
    """Strict JSON text of `doc`; non-finite floats become null (the fast path first)."""
    try:
        return json.dumps(doc, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(finite(doc), allow_nan=False, **kw)


class SafeJSONResponse(JSONResponse):
    """The app's JSON answer: strict JSON whatever floats the content holds."""

    def render(self, content: Any) -> bytes:
        return dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

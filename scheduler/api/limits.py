"""The one body decoder in front of every route: the size limit, counting the bytes actually
received (chunked bodies included), and text that JSON decodes but nothing downstream can encode.

A declared Content-Length over the limit is refused before reading; otherwise the body is read
up to the limit and replayed to the app, so a chunked upload that never declares its size is
cut off at `max_bytes + 1` and answered 413 without buffering the rest. A body that is not
UTF-8 (raw surrogate bytes `ED A0 80` among them: Python's JSON reader would pass them through
as a lone surrogate) or a JSON body holding a lone UTF-16 surrogate escape (`"\ud800"`) in any
string is answered 400 before any route sees it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from scheduler.api.jsontext import lone_surrogate_path, may_hold_surrogate


async def _reply_400_text(send, where: str, msg: str | None = None) -> None:
    msg = msg or f"{where}: a lone UTF-16 surrogate is not text (send valid Unicode)"
    body = json.dumps({"detail": msg, "reason": "invalid_text", "error": {
        "message": msg, "type": "invalid_request_error", "param": where, "code": "invalid_text"}}).encode()
    await send({"type": "http.response.start", "status": 400, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _surrogate_in(raw: bytes) -> str | None:
    if not may_hold_surrogate(raw):
        return None
    try:
        return lone_surrogate_path(json.loads(raw))
    except (ValueError, RecursionError):
        return None  # not JSON: the route's own parser answers


async def _reply_413(send, limit: int, tight: bool = False) -> None:
    # the API's {detail, reason} and, for the OpenAI-compatible gateway, an OpenAI error object
    msg = (f"request body exceeds {limit} bytes, more than a prompt the model takes can need" if tight
           else f"request body exceeds {limit} bytes")
    body = json.dumps({"detail": msg, "reason": "too_large", "error": {
        "message": msg, "type": "invalid_request_error", "param": None, "code": "body_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """`bounds`: per route path, a tighter limit once it is known (None: not yet) — the most
    bytes a body the route could accept can have (a prompt within the model's context): a
    longer one is refused by its declared length before a byte of it is read, or as soon as
    it streams past, instead of reading megabytes the route would refuse anyway."""

    def __init__(self, app, max_bytes: int, bounds: Mapping[str, Callable[[], int | None]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.bounds = dict(bounds or {})

    def _limit(self, path: str) -> tuple[int, bool]:
        """The limit for `path`, and whether it is the route's own (tighter) bound."""
        bound = self.bounds.get(path)
        tight = bound() if bound is not None else None
        return (tight, True) if tight is not None and tight < self.max_bytes else (self.max_bytes, False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, tight = self._limit(scope.get("path", ""))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                too_big = False  # a malformed header: the server layer rejects it
            if too_big:
                await _reply_413(send, limit, tight)
                return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away before the body ended
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await _reply_413(send, limit, tight)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if raw and not _is_utf8(raw):
            await _reply_400_text(send, "body", "the request body is not UTF-8 text (send valid Unicode)")
            return
        if (where := _surrogate_in(raw)) is not None:
            await _reply_400_text(send, where)
            return
        full = {"type": "http.request", "body": raw, "more_body": False}
        await self.app(scope, _replay([full], receive), send)


def _is_utf8(raw: bytes) -> bool:
    """Strict UTF-8 (what JSON text must be): encoded surrogates and overlong forms fail."""
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _replay(messages: list[dict], receive):
    async def replayed() -> dict:
        if messages:
            return messages.pop(0)
        return await receive()
    return replayed

"""Optional bearer-token auth for every route but /healthz (a pure ASGI middleware, so routes
mounted later — the gateway, /docs, /metrics — are covered without opting in)."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from scheduler.config import ConfigError

OPEN_PATHS = frozenset({"/healthz"})


def load_token(path: str | None) -> str | None:
    """The token in `path` (stripped), None when auth is off; an unreadable or empty file
    stops start-up with a ConfigError."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read scheduler.auth_token_file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"scheduler.auth_token_file {path} is empty")
    return token


class BearerAuth:
    def __init__(self, app, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self._expected):
            await self.app(scope, receive, send)
            return
        # the API's {detail, reason} and, for the OpenAI-compatible gateway, an OpenAI error object
        msg = "missing or invalid bearer token"
        body = json.dumps({"detail": msg, "reason": "unauthorized", "error": {
            "message": msg, "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

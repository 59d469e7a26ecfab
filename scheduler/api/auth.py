"""Bearer-token auth, on by default, for every route but /healthz: a pure ASGI middleware, so
routes mounted later (the gateway, /docs, /metrics) are covered without opting in. Where the
tokens come from: scheduler/contract/tokens.py."""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/healthz"})
SCRAPE_PATHS = frozenset({"/metrics"})


class BearerAuth:
    def __init__(self, app, token: str, scrape: str | None = None) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._scrape = f"Bearer {scrape}".encode() if scrape else None

    def _allowed(self, path: str, got: bytes) -> bool:
        if hmac.compare_digest(got, self._expected):
            return True
        return self._scrape is not None and path in SCRAPE_PATHS and hmac.compare_digest(got, self._scrape)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._allowed(scope["path"], dict(scope["headers"]).get(b"authorization", b"")):
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

"""The gateway's refusal: a request it will not serve, as an OpenAI-style error."""

from __future__ import annotations

__all__ = ["GatewayError"]


class GatewayError(Exception):
    """A request the gateway refuses; becomes an OpenAI-style error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

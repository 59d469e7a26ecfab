"""The gateway's refusal: a request it will not serve, as an OpenAI-style error. It is a
`CellflipError` like every other refusal (scheduler/contract/errors.py), with the status set
per refusal and the OpenAI `param` (the offending field) beside the code."""

from __future__ import annotations

from scheduler.contract.errors import CellflipError

__all__ = ["GatewayError"]


class GatewayError(CellflipError):
    """A request the gateway refuses; becomes an OpenAI-style error object."""

    code: str | None = None  # type: ignore[assignment]  (OpenAI's `code` may be null)

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, code)
        self.status = status  # type: ignore[misc]  (per refusal: 400, 404, 409, 413, ...)
        self.message = message
        self.param = param

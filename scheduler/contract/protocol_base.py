"""Base of the cell protocol's messages: JSON-able dataclasses validated by pydantic."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

MAX_WAIT_S = 1.0
"""Longest a sync is held open when there is nothing to send."""


class ProtocolError(ValueError):
    """A message that does not decode; the API answers 422."""


@cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


class Message:
    """Mixin: `to_dict` gives JSON-able dicts; `from_dict` validates (extra keys ignored)."""

    def to_dict(self) -> dict[str, Any]:
        return _adapter(type(self)).dump_python(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        try:
            return _adapter(cls).validate_python(dict(d))
        except ValidationError as e:
            raise ProtocolError(f"bad {cls.__name__}: {e.errors(include_url=False)}") from None

"""JSON columns of the store: how a row's structured fields (histories, capabilities, params,
sources, recorded answers) are written as text and read back. A leaf: imports no other module
of the scheduler."""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> str:
    """Compact JSON text of a structured column."""
    return json.dumps(obj, separators=(",", ":"))


def loads(text: str | None) -> Any:
    """The value of a structured column; None for SQL NULL."""
    return None if text is None else json.loads(text)

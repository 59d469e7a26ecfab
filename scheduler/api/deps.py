"""Dependencies: the controller lives on app.state (built by the lifespan), never in a global.

`ApiRoute` is the route class of every router here: malformed input is always a 422 whose
answer can be serialized (see its docstring)."""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from scheduler.contract.errors import Invalid
from scheduler.contract.records import Columns
from scheduler.control.controller import Controller


async def get_controller(request: Request) -> Controller:
    """Async on purpose: a plain function dependency is run on the thread pool, a thread hop
    per request that cost most of a small GET."""
    return request.app.state.controller


Ctl = Annotated[Controller, Depends(get_controller)]

_BODY_PARSE_ERROR = "There was an error parsing the body"
"""FastAPI's 400 for a body it could not read as JSON text (not UTF-8, nested too deep)."""


_ECHO_DEPTH = 16
"""How deep a validation error echoes its input (deeper parts become "..."): the echo stays
small and is rendered without deep recursion, whatever nesting the body had."""


def _json_safe(value: Any, depth: int = 0) -> Any:
    """`value` with NaN/±Infinity as strings and nesting cut at `_ECHO_DEPTH`: Python's json
    reads non-finite numbers from a request, and a validation error echoes its input, but a
    JSON answer cannot carry them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict | list | tuple) and depth >= _ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {k: _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v, depth + 1) for v in value]
    return value


class ApiRoute(APIRoute):
    """A route whose malformed requests are answered 422, never 400 or 500: a body that is
    not JSON text is an `Invalid`; a validation error has its non-finite inputs quoted."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPException as e:
                if e.status_code == 400 and e.detail == _BODY_PARSE_ERROR:
                    raise Invalid("request body is not valid JSON text") from None
                raise
            except RequestValidationError as e:
                raise RequestValidationError(_json_safe(list(e.errors())), body=e.body) from None

        return route


INT64_MAX = (1 << 63) - 1


def _check_columns(cols: Columns) -> None:
    """`check_int64` of token columns, one column at a time at C speed: a column's values share
    their type (the contract's validation made them so), so an integer column is checked by its
    least and greatest value, and a float or bool column holds no integer to check (nor does an
    `array` column, packed: its items are 32 bits at most)."""
    for col in cols.columns:
        if type(col) is array:
            continue
        if col and type(col[0]) is int:
            try:
                lo, hi = min(col), max(col)
            except TypeError:  # not one type after all: value by value
                check_int64(list(col))
                continue
            if lo < -INT64_MAX - 1 or hi > INT64_MAX:
                raise Invalid(f"integer {lo if lo < -INT64_MAX - 1 else hi} is out of the 64-bit range")
        elif col and type(col[0]) not in (float, bool):
            check_int64(list(col))


def check_sync_int64(body: Any) -> None:
    """`check_int64` of a `SyncRequest`: its token batches' integers a column at a time (every
    batch's epoch and start by their least and greatest, packed records not at all), the rest
    as `check_int64` walks it."""
    batches = body.tokens
    if batches:
        ints = [b.epoch for b in batches] + [b.start for b in batches]
        if min(ints) < -INT64_MAX - 1 or max(ints) > INT64_MAX:
            raise Invalid(f"integer {min(ints) if min(ints) < -INT64_MAX - 1 else max(ints)} is out of the 64-bit range")
        for b in batches:
            if type(b.records.columns[0]) is not array:
                _check_columns(b.records)
    check_int64([getattr(body, n) for n in _dataclass_fields(type(body)) or () if n != "tokens"])


def check_int64(msg: Any) -> None:
    """Every integer in `msg` (dataclasses, lists, dicts; walked without recursion) fits
    SQLite's 64-bit INTEGER: a larger id, count or port from a cell is malformed input (422),
    not a store error."""
    stack = [msg]
    while stack:
        v = stack.pop()
        t = type(v)
        if t in _LEAVES:
            continue
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise Invalid(f"integer {v} is out of the 64-bit range")
        elif (names := _dataclass_fields(t)) is not None:
            stack.extend(getattr(v, n) for n in names)
        elif isinstance(v, list | tuple):
            stack.extend(v)
        elif isinstance(v, Columns):
            _check_columns(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


_LEAVES = frozenset({str, float, bool, type(None), bytes})
"""Types that hold no integer (`check_int64` passes them at once)."""
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _dataclass_fields(t: type) -> tuple[str, ...] | None:
    """The field names of dataclass type `t` (None: not a dataclass), looked up once per type."""
    try:
        return _FIELDS[t]
    except KeyError:
        names = tuple(f.name for f in dataclasses.fields(t)) if dataclasses.is_dataclass(t) else None
        _FIELDS[t] = names
        return names

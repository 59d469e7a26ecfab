"""Token records, defined once: what a cell reports for each sampled token, and a stretch of
a session's token buffer, as the cells, the store and the API share them.

`TokenRecord` is one sampled token. On the wire a batch of them (`TokenRecords`) travels in one
of two forms, both always accepted:

- rows: a JSON array of `[token_id, logprob, version, truncated]` arrays (the original form);
- packed: `{"n": N, "ids": B64, "logprobs": B64, "versions": B64, "truncated": B64}`, each
  value the base64 of a little-endian array of N items: ids int32, log-probs float64 (bit for
  bit), versions int32, truncated uint8 0/1 (`truncated` may be left out when all are 0).
  17 bytes a token before base64, ~23 after (rows: ~40). The cells send this form
  (`TokenRecords.packed`); the scheduler keeps the arrays it decoded and stores their bytes.

Where tokens come in bulk they are columns, one sequence per field (tuples, or `array`s when
packed): `TokenRecords` (a sync's batch, a migration's tail) and `StoredTokens` (rows of the
session store), so ingest, the store and the API never build an object per token. Iterating or
indexing either still gives named rows, for code that takes tokens one at a time.

Fields are read by name; this module alone knows their positions (tests/test_shape.py).
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, overload

from pydantic_core import core_schema


class TokenRecord(NamedTuple):
    """One sampled token as the sampler produced it."""

    token_id: int
    logprob: float
    """Behaviour log-prob under the temperature-scaled distribution before top-p/top-k
    truncation (the behaviour policy's density, for the importance ratios)."""
    version: int
    """The weight version it was sampled under."""
    truncated: bool = False
    """Top-k/top-p truncation was active when it was sampled."""


class StoredToken(NamedTuple):
    """One row of a session's token buffer."""

    token_id: int
    loss_mask: int
    """1: sampled by the policy; 0: prompt or tool output."""
    logprob: float | None
    version: int | None
    truncated: int
    old_logprob: float | None
    provenance: str | None
    """`exact`, `missing`, or None while unscored."""


Row = TypeVar("Row", TokenRecord, StoredToken)


def _tuples(columns: tuple) -> tuple:
    """Columns as tuples (an `array` column compares equal to the tuple of its items)."""
    return tuple(c if type(c) is tuple else tuple(c) for c in columns)


def _column(i: int) -> property:
    return property(lambda self: self.columns[i])


class Columns(Sequence[Row], Generic[Row]):
    """Rows held as one tuple per field. `len`, slices (columns again) and iteration (named
    rows) behave as on a list of rows; equal to any sequence of equal rows."""

    ROW: ClassVar[type]
    __slots__ = ("columns",)

    def __init__(self, *columns: Sequence[Any]) -> None:
        width = len(self.ROW._fields)
        cols = tuple(tuple(c) for c in columns) if columns else ((),) * width
        if len(cols) != width or len({len(c) for c in cols}) > 1:
            raise ValueError(f"{type(self).__name__} takes {width} columns of one length")
        self.columns: tuple[tuple[Any, ...], ...] = cols

    @classmethod
    def _wrap(cls, columns: tuple[tuple[Any, ...], ...]):
        """Columns known to be well formed (a transpose, a slice), without checking them again."""
        new = object.__new__(cls)
        new.columns = columns
        return new

    @classmethod
    def of(cls, rows: Iterable[Sequence[Any]]):
        """From rows (named or plain tuples, lists), transposed at C speed."""
        rows = rows if isinstance(rows, list) else list(rows)
        if not rows:
            return cls()
        columns = tuple(zip(*rows, strict=True))
        if len(columns) != len(cls.ROW._fields):
            raise ValueError(f"{cls.__name__} takes rows of {len(cls.ROW._fields)} fields, not {len(columns)}")
        return cls._wrap(columns)

    def __len__(self) -> int:
        return len(self.columns[0])

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> Columns[Row]: ...
    def __getitem__(self, i: int | slice) -> Row | Columns[Row]:
        pick = itemgetter(i)
        if isinstance(i, slice):
            return self._wrap(tuple(map(pick, self.columns)))
        return self.ROW._make(map(pick, self.columns))

    def __iter__(self) -> Iterator[Row]:
        return map(self.ROW, *self.columns)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Columns):
            return type(other) is type(self) and _tuples(other.columns) == _tuples(self.columns)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(a == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class TokenRecords(Columns[TokenRecord]):
    """Sampled tokens as columns; on the wire rows or the packed form (module docstring)."""

    ROW = TokenRecord
    __slots__ = ()
    token_ids: tuple[int, ...] = _column(0)  # type: ignore[assignment]
    logprobs: tuple[float, ...] = _column(1)  # type: ignore[assignment]
    versions: tuple[int, ...] = _column(2)  # type: ignore[assignment]
    truncated: tuple[bool, ...] = _column(3)  # type: ignore[assignment]

    def rows(self) -> list[list[Any]]:
        """The row form: one `[token_id, logprob, version, truncated]` array per token."""
        ids, lps, vs, tr = self.columns
        if type(tr) is array:
            tr = map(bool, tr)
        return [list(r) for r in zip(ids, lps, vs, tr)]

    def __iter__(self) -> Iterator[TokenRecord]:
        ids, lps, vs, tr = self.columns
        return map(TokenRecord, ids, lps, vs, map(bool, tr) if type(tr) is array else tr)

    @property
    def is_packed(self) -> bool:
        return type(self.columns[0]) is array

    def packed(self) -> TokenRecords:
        """The same records held as arrays, which serialize to the packed wire form; `self`
        when a value does not fit its array (such a batch travels as rows, to be refused)."""
        if self.is_packed:
            return self
        ids, lps, vs, tr = self.columns
        try:
            return self._wrap((array("i", ids), array("d", lps), array("i", vs), array("B", map(bool, tr))))
        except (OverflowError, TypeError):
            return self

    def wire(self) -> list[list[Any]] | dict[str, Any]:
        """The wire form: packed when held as arrays, else rows."""
        if not self.is_packed:
            return self.rows()
        ids, lps, vs, tr = self.columns
        out: dict[str, Any] = {"n": len(ids), "ids": _b64(ids), "logprobs": _b64(lps), "versions": _b64(vs)}
        if any(tr):
            out["truncated"] = _b64(tr)
        return out

    @classmethod
    def joined(cls, parts: Sequence[TokenRecords]) -> TokenRecords | None:
        """Many batches' records as one (arrays, joined at C speed), to judge a sync's batches
        at once; None when a value does not fit its array (judge those batch by batch)."""
        out = (array("i"), array("d"), array("i"), array("B"))
        try:
            for part in parts:
                for col, src in zip(out, part.columns):
                    col.extend(src)
        except (OverflowError, TypeError):
            return None
        return cls._wrap(out)

    @classmethod
    def unpack(cls, wire: dict[str, Any]) -> TokenRecords:
        """From the packed wire form; a malformed one (base64, lengths, a `truncated` byte not
        0/1) raises ValueError, which validation answers as malformed input (422)."""
        n = wire["n"]
        if not 0 <= n <= MAX_PACKED:
            raise ValueError(f"packed records: n={n} is outside [0, {MAX_PACKED}]")
        text = wire.get("truncated")
        if text is None and not _SWAP:  # the common form: three columns, all well formed
            try:
                a, b, c = (_A2B(wire["ids"], strict_mode=True), _A2B(wire["logprobs"], strict_mode=True),
                           _A2B(wire["versions"], strict_mode=True))
            except (binascii.Error, ValueError):
                a = b = c = b"-"  # the field by field path below names what is wrong
            if len(a) == len(c) == 4 * n and len(b) == 8 * n:
                return cls._wrap((array("i", a), array("d", b), array("i", c), array("B", bytes(n))))
        ids, lps, vs = _unb64("i", wire["ids"], n, "ids"), _unb64("d", wire["logprobs"], n, "logprobs"), \
            _unb64("i", wire["versions"], n, "versions")
        tr = array("B", bytes(n)) if text is None else _unb64("B", text, n, "truncated")
        if n and max(tr) > 1:
            raise ValueError("packed records: truncated holds a byte other than 0 or 1")
        return cls._wrap((ids, lps, vs, tr))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        def columns(value: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> TokenRecords:
            if isinstance(value, cls):
                return value
            got = inner(value)
            return cls.unpack(got) if isinstance(got, dict) else cls.of(got)

        packed = core_schema.typed_dict_schema({
            "n": core_schema.typed_dict_field(core_schema.int_schema(strict=True)),
            **{k: core_schema.typed_dict_field(core_schema.str_schema(strict=True)) for _, k in _PACKED},
            "truncated": core_schema.typed_dict_field(
                core_schema.nullable_schema(core_schema.str_schema(strict=True)), required=False)})
        rows = handler.generate_schema(list[tuple[int, float, int, bool]])
        either = core_schema.tagged_union_schema(
            {"packed": packed, "rows": rows}, discriminator=lambda v: "packed" if isinstance(v, dict) else "rows")
        return core_schema.no_info_wrap_validator_function(
            columns, either, serialization=core_schema.plain_serializer_function_ser_schema(cls.wire))


MAX_PACKED = 1 << 24
"""Most records one packed batch may declare (the body's size limit binds far sooner)."""
_PACKED = (("i", "ids"), ("d", "logprobs"), ("i", "versions"))
_SWAP = sys.byteorder != "little"
_A2B = binascii.a2b_base64
assert array("i").itemsize == 4 and array("d").itemsize == 8


def _b64(a: array) -> str:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return base64.b64encode(a).decode("ascii")


def _unb64(code: str, text: str, n: int, name: str) -> array:
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"packed records: {name} is not base64") from None
    a = array(code)
    if len(raw) != n * a.itemsize:
        raise ValueError(f"packed records: {name} holds {len(raw)} bytes, not {n} x {a.itemsize}")
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()
    return a


class StoredTokens(Columns[StoredToken]):
    """A stretch of a session's token buffer as columns (`SessionStore.read`)."""

    ROW = StoredToken
    __slots__ = ()
    token_ids: tuple[int, ...] = _column(0)  # type: ignore[assignment]
    loss_mask: tuple[int, ...] = _column(1)  # type: ignore[assignment]
    logprobs: tuple[float | None, ...] = _column(2)  # type: ignore[assignment]
    versions: tuple[int | None, ...] = _column(3)  # type: ignore[assignment]
    truncated: tuple[int, ...] = _column(4)  # type: ignore[assignment]
    old_logprobs: tuple[float | None, ...] = _column(5)  # type: ignore[assignment]
    provenance: tuple[str | None, ...] = _column(6)  # type: ignore[assignment]


def same_tokens(stored: StoredTokens, records: TokenRecords) -> bool:
    """The stored tokens and the records name the same token, log-prob and version at every
    index both hold (compared column by column, at C speed)."""
    n = min(len(stored), len(records))
    if not n:
        return True
    return (stored.token_ids[:n] == tuple(records.token_ids[:n]) and stored.versions[:n] == tuple(records.versions[:n])
            and stored.logprobs[:n] == tuple(records.logprobs[:n]))

"""Token records, defined once: what a cell reports for each sampled token, and a stretch of
a session's token buffer, as the cells, the store and the API share them.

`TokenRecord` is one sampled token. On the wire it is a plain JSON array
`[token_id, logprob, version, truncated]` (as it always was: peers of either age read the same
lists). Where tokens come in bulk they are columns, one tuple per field: `TokenRecords` (a
sync's batch, a migration's tail) and `StoredTokens` (rows of the session store), so ingest,
the store and the API never build an object per token. Iterating or indexing either still
gives named rows, for code that takes tokens one at a time.

Fields are read by name; this module alone knows their positions (tests/test_shape.py).
"""

from __future__ import annotations

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
            return type(other) is type(self) and other.columns == self.columns
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(a == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class TokenRecords(Columns[TokenRecord]):
    """Sampled tokens as columns; on the wire a list of `TokenRecord` arrays."""

    ROW = TokenRecord
    __slots__ = ()
    token_ids: tuple[int, ...] = _column(0)  # type: ignore[assignment]
    logprobs: tuple[float, ...] = _column(1)  # type: ignore[assignment]
    versions: tuple[int, ...] = _column(2)  # type: ignore[assignment]
    truncated: tuple[bool, ...] = _column(3)  # type: ignore[assignment]

    def rows(self) -> list[list[Any]]:
        """The wire form: one `[token_id, logprob, version, truncated]` array per token."""
        return [list(r) for r in zip(*self.columns)]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        def columns(value: Any, rows: core_schema.ValidatorFunctionWrapHandler) -> TokenRecords:
            return value if isinstance(value, cls) else cls.of(rows(value))

        return core_schema.no_info_wrap_validator_function(
            columns, handler.generate_schema(list[tuple[int, float, int, bool]]),
            serialization=core_schema.plain_serializer_function_ser_schema(cls.rows))


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
    return (stored.token_ids[:n] == records.token_ids[:n] and stored.versions[:n] == records.versions[:n]
            and stored.logprobs[:n] == records.logprobs[:n])

"""The packed form of a session's tokens: one `token_chunks` row per run of tokens, its
per-token fields as little-endian arrays (a leaf: no SQL, no store).

A chunk is a run of consecutive buffer indices `[start, start + n)` of one session that share
their loss mask, behaviour version, ownership epoch and sampling cell (a sync batch's new
tokens of one version, a migration commit's tail, a prompt). Its per-token BLOBs:

- `token_ids`: int32 (`array('i')`), always present;
- `logprobs`: float64, the behaviour log-probs exactly as reported (NULL for a prompt chunk);
- `truncated`: uint8 0/1 (NULL when every token is 0);
- `old_logprobs`: float64, NaN where there is none (NULL while no token has one);
- `provenance`: uint8, 0 = none (unscored), 1 = `exact`, 2 = `missing` (NULL while all 0).

Counts kept beside them (so the scoring backlog and the per-version accounting read one row
per chunk, never a token): `unscored` (sampled tokens with provenance 0), `ufirst`/`ulast`
(the first and last unscored index, NULL when none), `exact`, `missing`.
"""

from __future__ import annotations

import math
import sys
from array import array
from dataclasses import dataclass
from itertools import groupby, repeat
from typing import Any

from scheduler.contract.errors import Invalid

PROV_CODE = {None: 0, "exact": 1, "missing": 2}
PROV_NAME = (None, "exact", "missing")
_NAN = float("nan")
_SWAP = sys.byteorder != "little"
assert array("i").itemsize == 4 and array("d").itemsize == 8

COLS = ("session_id, start, n, loss_mask, version, epoch, cell, unscored, ufirst, ulast, exact, missing, token_ids, "
        "logprobs, truncated, old_logprobs, provenance")
"""The `token_chunks` columns, in `Chunk.row()` order."""


def _arr(code: str, blob: bytes | None) -> array:
    a = array(code)
    if blob:
        a.frombytes(blob)
        if _SWAP:
            a.byteswap()
    return a


def _blob(a: array) -> bytes:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def ids_array(token_ids: Any) -> array:
    """Token ids as int32; an id outside int32 is refused (422, nothing is written). An int32
    array (a packed batch's ids, as received) is taken as it is."""
    if type(token_ids) is array and token_ids.typecode == "i":
        return token_ids
    try:
        return array("i", token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not -(1 << 31) <= t < 1 << 31)
        raise Invalid(f"token id {bad} does not fit a 32-bit token id", code="bad_token") from None


@dataclass(slots=True)
class Chunk:
    session_id: str
    start: int
    loss_mask: int
    version: int | None
    epoch: int | None
    cell: str | None
    ids: array
    logprobs: array | None = None
    truncated: bytes | None = None
    old: array | None = None
    prov: bytearray | None = None

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @classmethod
    def from_row(cls, r: tuple) -> Chunk:
        """From a row of `COLS`."""
        return cls(r[0], r[1], r[3], r[4], r[5], r[6], _arr("i", r[12]), None if r[13] is None else _arr("d", r[13]),
                   r[14], None if r[15] is None else _arr("d", r[15]), None if r[16] is None else bytearray(r[16]))

    def counts(self) -> tuple[int, int | None, int | None, int, int]:
        """(unscored, first unscored index, last unscored index, exact, missing)."""
        if not self.loss_mask:
            return 0, None, None, 0, 0
        if self.prov is None:
            return self.n, self.start, self.end - 1, 0, 0
        p = self.prov
        un = p.count(0)
        first = p.find(0)
        return (un, None if first < 0 else self.start + first, None if first < 0 else self.start + p.rfind(0),
                p.count(1), p.count(2))

    def row(self) -> tuple:
        """The chunk as a row of `COLS`."""
        prov = None if self.prov is None or not any(self.prov) else bytes(self.prov)
        old = None if self.old is None or prov is None else _blob(self.old)
        trunc = bytes(self.truncated) if self.truncated and any(self.truncated) else None
        return (self.session_id, self.start, self.n, self.loss_mask, self.version, self.epoch, self.cell,
                *self.counts(), _blob(self.ids), None if self.logprobs is None else _blob(self.logprobs), trunc, old,
                prov)

    def head(self, k: int) -> Chunk:
        """The chunk's first `k` tokens."""
        return Chunk(self.session_id, self.start, self.loss_mask, self.version, self.epoch, self.cell, self.ids[:k],
                     None if self.logprobs is None else self.logprobs[:k],
                     None if self.truncated is None else self.truncated[:k],
                     None if self.old is None else self.old[:k], None if self.prov is None else self.prov[:k])

    def scoring(self) -> tuple[array, bytearray]:
        """The old log-prob and provenance arrays, made writable (materialized when absent)."""
        if self.prov is None:
            self.prov = bytearray(self.n)
        if self.old is None:
            self.old = array("d", repeat(_NAN, self.n))
        return self.old, self.prov

    # -- the per-token columns (StoredToken's fields, scheduler/contract/records.py)
    def columns(self, lo: int, hi: int) -> tuple[tuple, ...]:
        """Tokens [lo, hi) (buffer indices, inside the chunk) as (token_ids, loss_mask,
        logprobs, versions, truncated, old_logprobs, provenance) columns."""
        a, b, k = lo - self.start, hi - self.start, hi - lo
        ids = tuple(self.ids[a:b])
        lps = tuple(self.logprobs[a:b]) if self.logprobs is not None else (None,) * k
        trunc = tuple(self.truncated[a:b]) if self.truncated is not None else (0,) * k
        if self.prov is None:
            old: tuple = (None,) * k
            prov: tuple = (None,) * k
        else:
            old = tuple(None if math.isnan(x) else x for x in self.old[a:b]) if self.old is not None else (None,) * k
            prov = tuple(PROV_NAME[c] for c in self.prov[a:b])
        return ids, (self.loss_mask,) * k, lps, (self.version,) * k, trunc, old, prov


def sampled_chunks(session_id: str, at: int, token_ids: Any, logprobs: Any, versions: Any, truncated: Any,
                   epoch: int | None, cell: str | None) -> list[Chunk]:
    """Sampled tokens (columns) appended at `at` as chunks, one per run of equal versions."""
    if versions and versions.count(versions[0]) == len(versions):  # one version: one chunk (C speed)
        lps = logprobs if type(logprobs) is array and logprobs.typecode == "d" else array("d", logprobs)
        return [Chunk(session_id, at, 1, versions[0], epoch, cell, ids_array(token_ids), lps,
                      bytes(truncated) if any(truncated) else None)]
    out: list[Chunk] = []
    pos = 0
    for version, run in groupby(versions):
        k = sum(1 for _ in run)
        trunc = bytes(truncated[pos:pos + k]) if any(truncated[pos:pos + k]) else None
        out.append(Chunk(session_id, at + pos, 1, version, epoch, cell, ids_array(token_ids[pos:pos + k]),
                         array("d", logprobs[pos:pos + k]), trunc))
        pos += k
    return out


def sampled_rows(session_id: str, at: int, token_ids: Any, logprobs: Any, versions: Any, truncated: Any,
                 epoch: int | None, cell: str | None) -> list[tuple]:
    """`sampled_chunks(...)` as rows of `COLS` (`Chunk.row()` of each): a batch of one version,
    the common case, straight from its columns to its row, with no `Chunk` in between."""
    n = len(versions)
    if not n or versions.count(versions[0]) != n:
        return [c.row() for c in sampled_chunks(session_id, at, token_ids, logprobs, versions, truncated, epoch, cell)]
    lps = logprobs if type(logprobs) is array and logprobs.typecode == "d" else array("d", logprobs)
    if len(lps) != n or len(token_ids) != n or len(truncated) != n:
        raise ValueError(f"sampled tokens at {at} of session {session_id}: columns of unequal lengths")
    return [(session_id, at, n, 1, versions[0], epoch, cell, n, at, at + n - 1, 0, 0, _blob(ids_array(token_ids)),
             _blob(lps), bytes(truncated) if any(truncated) else None, None, None)]


def prompt_chunk(session_id: str, at: int, token_ids: Any) -> Chunk:
    return Chunk(session_id, at, 0, None, None, None, ids_array(token_ids))

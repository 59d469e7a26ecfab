"""Sessions' token buffers, stored column-packed: one `token_chunks` row per run of tokens
(scheduler/store/tokenpack.py says what a chunk holds and how its BLOBs are laid out).

A sync of 32 batches x 16 tokens writes 32 rows, not 512; the scoring backlog and the
per-version accounting read one row per chunk (`unscored`, `exact`, `missing` counts and a
small partial index over chunks with unscored tokens). Per-token reads unpack the chunks they
overlap; per-token writes (old log-probs, provenance, a truncation) rewrite the chunks they
touch. A store written with the former layout (one `tokens` row per token) is converted on
open (`migrate_legacy`).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING

from scheduler.store.tokenpack import COLS, PROV_CODE, Chunk

if TYPE_CHECKING:
    from scheduler.store.base import Database

_KEY = "session_id = {r}.session_id AND version = COALESCE({r}.version, -1)"
_ADD = ("INSERT INTO token_backlog(session_id, version, s0, s1, lo, hi, n) SELECT NEW.session_id,"
        " COALESCE(NEW.version, -1), NEW.start, NEW.start, NEW.ufirst, NEW.ulast, NEW.unscored WHERE NEW.unscored > 0"
        " ON CONFLICT(session_id, version) DO UPDATE SET s0 = min(s0, excluded.s0), s1 = max(s1, excluded.s1),"
        " lo = min(lo, excluded.lo), hi = max(hi, excluded.hi), n = n + excluded.n;")
_TAKE = (f"UPDATE token_backlog SET n = n - OLD.unscored, stale = 1 WHERE {_KEY.format(r='OLD')} AND OLD.unscored > 0;"
         f" DELETE FROM token_backlog WHERE {_KEY.format(r='OLD')} AND n <= 0;")
BACKLOG_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS token_backlog(
  session_id TEXT NOT NULL, version INTEGER NOT NULL, s0 INTEGER NOT NULL, s1 INTEGER NOT NULL, lo INTEGER,
  hi INTEGER, n INTEGER NOT NULL, stale INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(session_id, version)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS backlog_version ON token_backlog(version);
CREATE TRIGGER IF NOT EXISTS backlog_add AFTER INSERT ON token_chunks WHEN NEW.unscored > 0 BEGIN {_ADD} END;
CREATE TRIGGER IF NOT EXISTS backlog_take AFTER DELETE ON token_chunks WHEN OLD.unscored > 0 BEGIN {_TAKE} END;
CREATE TRIGGER IF NOT EXISTS backlog_rescore AFTER UPDATE OF unscored, ufirst, ulast ON token_chunks
  WHEN OLD.unscored > 0 OR NEW.unscored > 0 BEGIN {_TAKE} {_ADD}
  UPDATE token_backlog SET stale = 1 WHERE {_KEY.format(r='NEW')};
END;
"""
"""The scoring backlog, one row per (session, version) with unscored sampled tokens (version
NULL kept as -1): the first and last chunk start (`s0`, `s1`), the first and last unscored index
(`lo`, `hi`) and the count `n`, kept by triggers on `token_chunks` (so every writer keeps it, in
the writer's transaction). An insert widens the bounds exactly; a delete or a rescore keeps `n`
exact but can only narrow the bounds, so it marks the row `stale` and `TokenBuffer.restate`
recomputes it from the chunks between its bounds before the backlog is read."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS token_chunks(
  session_id TEXT NOT NULL, start INTEGER NOT NULL, n INTEGER NOT NULL, loss_mask INTEGER NOT NULL,
  version INTEGER, epoch INTEGER, cell TEXT, unscored INTEGER NOT NULL, ufirst INTEGER, ulast INTEGER,
  exact INTEGER NOT NULL, missing INTEGER NOT NULL, token_ids BLOB NOT NULL, logprobs BLOB, truncated BLOB,
  old_logprobs BLOB, provenance BLOB);
CREATE UNIQUE INDEX IF NOT EXISTS chunks_at ON token_chunks(session_id, start);
DROP INDEX IF EXISTS chunks_unscored;
DROP INDEX IF EXISTS chunks_backlog;
""" + BACKLOG_SCHEMA

_INSERT_MANY, _ROW = f"INSERT INTO token_chunks({COLS}) VALUES ", f"({','.join('?' * 17)})"
ROWS_PER_INSERT = 500
"""Rows one multi-row INSERT carries at most (8,500 bound values: within SQLite's 32,766)."""
_SCORED = ("UPDATE token_chunks SET unscored=?, ufirst=?, ulast=?, exact=?, missing=?, old_logprobs=?, provenance=?"
           " WHERE session_id=? AND start=?")


class TokenBuffer:
    """The SQL over `token_chunks`; `SessionStore` keeps the sessions' lengths."""

    def __init__(self, store: Database) -> None:
        self.s = store

    def insert(self, chunks: Sequence[Chunk]) -> None:
        self.insert_rows([c.row() for c in chunks])

    def insert_rows(self, rows: list[tuple]) -> None:
        """Chunks already as rows of `COLS` (`Chunk.row()`, `tokenpack.sampled_rows`): one
        multi-row INSERT per `ROWS_PER_INSERT` rows (a sync's 32 batches: one statement)."""
        for at in range(0, len(rows), ROWS_PER_INSERT):
            part = rows[at:at + ROWS_PER_INSERT]
            self.s.execute(f"{_INSERT_MANY}{','.join([_ROW] * len(part))}", [x for r in part for x in r])

    def replace(self, chunks: Sequence[Chunk]) -> None:
        """Write chunks over the stored ones at their (session, start)."""
        self.s.executemany("DELETE FROM token_chunks WHERE session_id=? AND start=?",
                           [(c.session_id, c.start) for c in chunks])
        self.insert(chunks)

    def chunks(self, session_id: str, start: int = 0, end: int | None = None) -> list[Chunk]:
        """The chunks overlapping [start, end), in order."""
        stop = end if end is not None else 1 << 62
        if start >= stop:
            return []
        (first,) = self.s.execute("SELECT MAX(start) FROM token_chunks WHERE session_id=? AND start<=?",
                                  (session_id, start)).fetchone()
        q = f"SELECT {COLS} FROM token_chunks WHERE session_id=? AND start>=? AND start<? ORDER BY start"
        rows = self.s.execute(q, (session_id, start if first is None else first, stop)).fetchall()
        return [c for c in map(Chunk.from_row, rows) if c.end > start]

    def columns(self, session_id: str, start: int = 0, end: int | None = None) -> tuple[tuple, ...]:
        """Tokens [start, end) as `StoredTokens`' seven columns."""
        parts = [c.columns(max(start, c.start), c.end if end is None else min(end, c.end))
                 for c in self.chunks(session_id, start, end)]
        if not parts:
            return ((),) * 7
        if len(parts) == 1:
            return parts[0]
        return tuple(tuple(chain.from_iterable(col)) for col in zip(*parts))

    def per_token(self, session_id: str, start: int, end: int | None, field: str) -> Iterator[tuple[int, object]]:
        """(index, the chunk's `field`) of each token in [start, end)."""
        for c in self.chunks(session_id, start, end):
            lo, hi = max(start, c.start), c.end if end is None else min(end, c.end)
            yield from zip(range(lo, hi), repeat(getattr(c, field)))

    def truncate(self, session_id: str, at: int) -> int:
        """Remove the tokens from `at` on; returns how many."""
        cut = self.chunks(session_id, at, at + 1)
        (n,) = self.s.execute("SELECT COALESCE(SUM(n), 0) FROM token_chunks WHERE session_id=? AND start>=?",
                              (session_id, at)).fetchone()
        self.s.execute("DELETE FROM token_chunks WHERE session_id=? AND start>=?", (session_id, at))
        if cut and cut[0].start < at:
            c = cut[0]
            self.replace([c.head(at - c.start)])
            n += c.end - at
        return n

    def delete_session(self, session_id: str) -> None:
        self.s.execute("DELETE FROM token_chunks WHERE session_id=?", (session_id,))

    def rescore(self, session_id: str, start: int, end: int | None, values: Sequence[float | None] | None,
                provenance: str, version: int | None = None, only_unscored: bool = False) -> int:
        """Set the old log-prob and provenance of the sampled tokens in [start, end) (of
        `version` when given): each to `values[i - start]` (None: no value), or with `values`
        None every one to no value. `only_unscored`: only tokens still unscored. Returns how
        many tokens were set."""
        code, changed, rows = PROV_CODE[provenance], 0, []
        nan = float("nan")
        for c in self.chunks(session_id, start, end):
            if not c.loss_mask or (version is not None and c.version != version):
                continue
            old, prov = c.scoring()
            lo, hi, k = max(start, c.start), c.end if end is None else min(end, c.end), 0
            for i in range(lo, hi):
                j = i - c.start
                if only_unscored and prov[j]:
                    continue
                v = None if values is None else values[i - start]
                if v is None and code != 2:
                    continue  # no value: only `missing` is written without one
                old[j], prov[j] = (nan if v is None else v), code
                k += 1
            if k:
                changed += k
                r = c.row()
                rows.append((*r[7:12], r[15], r[16], session_id, c.start))
        self.s.executemany(_SCORED, rows)
        return changed

    def samplers_from(self, cell_id: str) -> list[tuple[str, int]]:
        q = "SELECT session_id, MIN(start) FROM token_chunks WHERE cell=? AND loss_mask=1 GROUP BY session_id"
        return self.s.execute(q, (cell_id,)).fetchall()

    def version_counts(self) -> dict[int, dict[str, int]]:
        """Per behaviour version: sampled tokens, exact, missing and unscored counts."""
        q = ("SELECT version, SUM(n), SUM(exact), SUM(missing), SUM(unscored) FROM token_chunks WHERE loss_mask=1"
             " GROUP BY version")
        return {v: {"generated": g, "exact": e, "missing": m, "unscored": u} for v, g, e, m, u in self.s.execute(q)}

    def unscored_by_version(self) -> dict[int, int]:
        q = "SELECT NULLIF(version, -1), SUM(n) FROM token_backlog GROUP BY version"
        return dict(self.s.execute(q).fetchall())

    def unscored(self, version: int) -> int:
        q = "SELECT COALESCE(SUM(n), 0) FROM token_backlog WHERE version=?"
        return self.s.execute(q, (version,)).fetchone()[0]

    def restate(self) -> int:
        """Recompute the backlog rows a delete or a rescore left `stale` (their bounds), each
        from its chunks between its old bounds; returns how many."""
        stale = self.s.execute("SELECT session_id, version, s0, s1 FROM token_backlog WHERE stale = 1").fetchall()
        if not stale:
            return 0
        with self.s.tx(durable=False):
            for sid, v, s0, s1 in stale:
                lo, hi, n, a, b = self.s.execute(_RESTATE, (sid, s0, s1, v)).fetchone()
                if n:
                    self.s.execute("UPDATE token_backlog SET s0=?, s1=?, lo=?, hi=?, n=?, stale=0"
                                   " WHERE session_id=? AND version=?", (a, b, lo, hi, n, sid, v))
                else:
                    self.s.execute("DELETE FROM token_backlog WHERE session_id=? AND version=?", (sid, v))
        return len(stale)

    def unscored_ranges(self, limit: int) -> list[tuple]:
        """Per (request, version) with unscored sampled tokens, oldest requests first: the
        request's columns, the version, the first and last unscored index, the count.

        The backlog is read one row per (session, version) from `token_backlog` (its stale
        rows restated first: `restate`), and each row is matched with the one request whose
        tokens hold all of it: one lookup per session, not per chunk. A row no single request
        holds (a session with unscored tokens in several turns) is taken chunk by chunk against
        the requests of its session (`_EXACT`); both lists come sorted and are merged."""
        self.restate()
        clean: list[tuple] = []
        split: set[str] = set()
        for r in self.s.execute(_GROUPS):  # the groups no single request holds come first
            if r[0] is None:
                split.add(r[13])
            elif len(clean) >= limit:
                break
            elif r[1] not in split:  # a split session is taken whole by `_EXACT`
                clean.append(r)
        exact: list[tuple] = []
        ids = sorted(split)
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            exact += self.s.execute(_EXACT.format(",".join("?" * len(part))), (*part, limit)).fetchall()
        if exact:
            clean = list(heapq.merge(clean, sorted(exact, key=_order), key=_order))
        return [r[:12] for r in clean[:limit]]


def _order(r: tuple) -> tuple:
    return r[12], r[0], r[8]


_RESTATE = ("SELECT MIN(ufirst), MAX(ulast), SUM(unscored), MIN(start), MAX(start) FROM token_chunks"
            " WHERE session_id=? AND start BETWEEN ? AND ? AND COALESCE(version, -1)=? AND unscored > 0")
_GROUPS = ("SELECT r.id, r.session_id, r.prompt_start, r.base, r.num_generated, r.params, r.state,"
           " r.cell_id, NULLIF(g.version, -1), g.lo, g.hi, g.n, r.created_at, g.session_id FROM token_backlog g"
           " LEFT JOIN requests r ON r.session_id = g.session_id AND r.base <= g.s0 AND g.s1 < r.base + r.num_generated"
           " ORDER BY r.id IS NOT NULL, r.created_at, r.id, g.version")
_EXACT = ("SELECT r.id, r.session_id, r.prompt_start, r.base, r.num_generated, r.params, r.state, r.cell_id,"
          " c.version, MIN(c.ufirst), MAX(c.ulast), SUM(c.unscored), r.created_at FROM token_backlog g"
          " CROSS JOIN token_chunks c ON c.session_id = g.session_id AND c.start BETWEEN g.s0 AND g.s1"
          " AND COALESCE(c.version, -1) = g.version"
          " CROSS JOIN requests r ON c.session_id = r.session_id AND c.start >= r.base"
          " AND c.start < r.base + r.num_generated WHERE c.unscored > 0 AND g.session_id IN ({})"
          " GROUP BY r.id, c.version ORDER BY r.created_at, r.id, c.version LIMIT ?")
"""The scoring backlog's queries (`TokenBuffer.unscored_ranges`)."""


def rebuild_backlog(store: Database) -> None:
    """Recount `token_backlog` from the chunks (a store written before it existed)."""
    with store.tx(durable=True):
        store.execute("DELETE FROM token_backlog")
        store.execute("INSERT INTO token_backlog(session_id, version, s0, s1, lo, hi, n) SELECT session_id,"
                      " COALESCE(version, -1), MIN(start), MAX(start), MIN(ufirst), MAX(ulast), SUM(unscored)"
                      " FROM token_chunks WHERE unscored > 0 GROUP BY session_id, COALESCE(version, -1)")


_LEGACY_COLS = ("session_id", "idx", "token_id", "loss_mask", "logprob", "version", "truncated", "old_logprob",
                "provenance", "epoch", "cell")


def migrate_legacy(store: Database) -> int:
    """Convert a store's former per-token `tokens` table (if any) into chunks, then drop it;
    returns the tokens converted. One transaction: an interrupted conversion leaves the old
    table whole, to be converted at the next open."""
    if store.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='tokens'").fetchone() is None:
        return 0
    have = {r[1] for r in store.execute("PRAGMA table_info(tokens)")}
    cols = ", ".join(c if c in have else "NULL" for c in _LEGACY_COLS)
    buf, total = TokenBuffer(store), 0
    with store.tx(durable=True):
        sessions = [sid for (sid,) in store.execute("SELECT DISTINCT session_id FROM tokens")]
        for sid in sessions:
            rows = store.execute(f"SELECT {cols} FROM tokens WHERE session_id=? ORDER BY idx", (sid,)).fetchall()
            buf.insert(list(legacy_chunks(rows)))
            total += len(rows)
        store.execute("DROP TABLE tokens")
    return total


def legacy_chunks(rows: list[tuple]) -> Iterator[Chunk]:
    """Per-token rows (`_LEGACY_COLS`) of one session as chunks: a new chunk wherever the index
    jumps or the mask, version, epoch or cell changes."""
    cur: Chunk | None = None
    for sid, idx, tok, mask, lp, ver, trunc, old, prov, epoch, cell in rows:
        if cur is None or idx != cur.end or (mask, ver, epoch, cell) != (cur.loss_mask, cur.version, cur.epoch,
                                                                          cur.cell):
            if cur is not None:
                yield cur
            cur = Chunk(sid, idx, mask, ver, epoch, cell, array("i"), array("d") if mask else None, bytearray(),
                        array("d"), bytearray())
        cur.ids.append(tok)
        if cur.logprobs is not None:
            cur.logprobs.append(float("nan") if lp is None else lp)
        cur.truncated.append(1 if trunc else 0)
        cur.old.append(float("nan") if old is None else old)
        cur.prov.append(PROV_CODE.get(prov, 0))
    if cur is not None:
        yield cur

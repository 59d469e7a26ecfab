"""The durable store: one SQLite file in WAL mode, the scheduler's source of truth.

Table groups live in their own modules: `store_fleet` (cells, flips, versions, idempotency
keys), `store_owners` (requests with their owner cell and epoch, migrations), `store_sessions`
(token buffers and trajectories). A restarted scheduler rebuilds from this file plus a fresh
re-list of the cells.

Ownership, flips and versions commit with `synchronous=FULL` (`tx(durable=True)`): a commit
that told a cell "you own epoch e+1" must survive a power cut. Token batches commit with
`synchronous=NORMAL` (still atomic and crash-safe in WAL; only the last batches can be lost to
a power cut, and a later FULL commit flushes them too).

The connection is used from the event loop's thread only (every handler is async and every
store call is synchronous), so transactions never interleave.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS cells(
  id TEXT PRIMARY KEY, incarnation TEXT NOT NULL, state TEXT NOT NULL,
  generation INTEGER NOT NULL, version INTEGER, address TEXT NOT NULL, store_port INTEGER NOT NULL,
  capabilities TEXT NOT NULL, kv_blocks_total INTEGER NOT NULL, kv_blocks_used INTEGER NOT NULL,
  max_running INTEGER NOT NULL, history TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flips(
  id TEXT PRIMARY KEY, cell_id TEXT NOT NULL, to_role TEXT NOT NULL, state TEXT NOT NULL,
  idem_key TEXT, reason TEXT, migrated INTEGER NOT NULL, suspended INTEGER NOT NULL,
  recomputed INTEGER NOT NULL, created_at REAL NOT NULL, finished_at REAL, history TEXT NOT NULL,
  kv_store INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS flips_state ON flips(state);
CREATE TABLE IF NOT EXISTS versions(
  v INTEGER PRIMARY KEY, state TEXT NOT NULL, created_at REAL NOT NULL, history TEXT NOT NULL,
  source TEXT);
CREATE TABLE IF NOT EXISTS idempotency(
  scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL, response TEXT NOT NULL,
  created_at REAL NOT NULL, PRIMARY KEY(scope, key));
CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency(created_at);
CREATE TABLE IF NOT EXISTS requests(
  id TEXT PRIMARY KEY, session_id TEXT NOT NULL, base INTEGER NOT NULL, prompt_start INTEGER NOT NULL,
  num_generated INTEGER NOT NULL, params TEXT NOT NULL, cell_id TEXT, epoch INTEGER NOT NULL,
  state TEXT NOT NULL, reason TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS requests_state ON requests(state, cell_id);
CREATE INDEX IF NOT EXISTS requests_session ON requests(session_id, state);
CREATE TABLE IF NOT EXISTS migrations(
  id TEXT PRIMARY KEY, request_id TEXT NOT NULL, src TEXT NOT NULL, dst TEXT NOT NULL,
  epoch INTEGER NOT NULL, state TEXT NOT NULL, path TEXT NOT NULL, flip_id TEXT, reason TEXT,
  created_at REAL NOT NULL, finished_at REAL, history TEXT NOT NULL,
  src_state TEXT NOT NULL DEFAULT 'running');
CREATE INDEX IF NOT EXISTS migrations_state ON migrations(state, request_id);
CREATE TABLE IF NOT EXISTS sessions(
  id TEXT PRIMARY KEY, state TEXT NOT NULL, length INTEGER NOT NULL, segment_starts TEXT NOT NULL,
  reward REAL, group_id TEXT, finish_seq INTEGER, created_at REAL NOT NULL, finished_at REAL);
CREATE UNIQUE INDEX IF NOT EXISTS sessions_finish ON sessions(finish_seq);
CREATE TABLE IF NOT EXISTS tokens(
  session_id TEXT NOT NULL, idx INTEGER NOT NULL, token_id INTEGER NOT NULL,
  loss_mask INTEGER NOT NULL, logprob REAL, version INTEGER, truncated INTEGER NOT NULL,
  old_logprob REAL, provenance TEXT, PRIMARY KEY(session_id, idx)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tokens_version ON tokens(version, provenance) WHERE loss_mask = 1;
CREATE INDEX IF NOT EXISTS tokens_unscored ON tokens(version) WHERE loss_mask = 1 AND provenance IS NULL;
"""

ADDED_COLUMNS = (
    ("migrations", "src_state", "TEXT NOT NULL DEFAULT 'running'"),
    ("flips", "kv_store", "INTEGER NOT NULL DEFAULT 0"),
)
"""Columns added after a table's first release: a store written by an older scheduler gets
them (with their defaults) when it is opened, so a restart across an upgrade keeps its state."""


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    """Owns the connection and the transaction scope; table groups hang off it."""

    def __init__(self, path: str | Path) -> None:
        from scheduler.store_fleet import FleetStore
        from scheduler.store_owners import OwnerStore
        from scheduler.store_sessions import SessionStore

        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in `tx`).
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(SCHEMA)
        self._add_missing_columns()
        self._depth = 0
        self._durable = True
        self.fleet = FleetStore(self)
        self.owners = OwnerStore(self)
        self.sessions = SessionStore(self)

    @contextmanager
    def tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One atomic transaction; nested calls join the outermost (whose durability wins)."""
        if self._depth:
            assert self._durable or not durable, "a durable write nested in a non-durable transaction"
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        if durable != self._durable:
            self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._durable = durable
        self.conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")
        finally:
            self._depth = 0

    def _add_missing_columns(self) -> None:
        for table, column, decl in ADDED_COLUMNS:
            have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def execute(self, sql: str, params: tuple | list = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def close(self) -> None:
        self.conn.close()

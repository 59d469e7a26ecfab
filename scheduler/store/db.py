"""The durable store: one SQLite file in WAL mode, the scheduler's source of truth.

Each table group lives in its own module with its rows and its SQL: `fleet` (cells, flips,
versions, idempotency keys), `owners` (requests with their owner cell and epoch, migrations),
`sessions` (token buffers, trajectories and the gateway's per-session state), `jobs` (the RL
jobs the fleet serves and what belongs to each). A restarted
scheduler rebuilds from this file plus a fresh re-list of the cells.

Ownership, flips and versions commit with `synchronous=FULL` (`tx(durable=True)`): a commit
that told a cell "you own epoch e+1" must survive a power cut. Token batches commit with
`synchronous=NORMAL` (still atomic and crash-safe in WAL; only the last batches can be lost to
a power cut, and a later FULL commit flushes them too).

The connection is used from the event loop's thread only (every handler is async and every
store call is synchronous), so transactions never interleave.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scheduler.store import context as session_context
from scheduler.store import (
    counters,
    exportread,
    fleet,
    jobs,
    messages,
    owners,
    retention,
    sessions,
    tokens,
)
from scheduler.store.tokenbuf import migrate_legacy, rebuild_backlog

SCHEMA = (fleet.SCHEMA + owners.SCHEMA + sessions.SCHEMA + tokens.SCHEMA + retention.SCHEMA
          + session_context.SCHEMA + messages.SCHEMA + jobs.SCHEMA)
"""Every table and index (table and column names are read by faultkit's checker too)."""

ADDED_COLUMNS = (
    ("migrations", "src_state", "TEXT NOT NULL DEFAULT 'running'"),
    ("flips", "kv_store", "INTEGER NOT NULL DEFAULT 0"),
    ("migrations", "commit_tokens", "INTEGER"),
    ("sessions", "agent", "TEXT"),
    ("cells", "trust", "TEXT NOT NULL DEFAULT 'unverified'"),
    ("cells", "probe", "TEXT"),
    ("sessions", "tainted", "INTEGER NOT NULL DEFAULT 0"),
    ("migrations", "stall_s", "REAL"),
)
"""Columns added after a table's first release: a store written by an older scheduler gets
them (with their defaults) when it is opened, so a restart across an upgrade keeps its state."""


CACHE_KIB = 64 * 1024
"""The connection's page cache, at most (filled only as pages are read)."""
WAL_CHECKPOINT_PAGES = 4000
"""WAL pages (4 KiB each) between automatic checkpoints (SQLite's default: 1,000)."""


class Store:
    """Owns the connection and the transaction scope; table groups hang off it."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in `tx`).
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        # statement journals and savepoints' sub-journals (a multi-row write with triggers, each
        # sync's part of a group commit) in memory, not temp files: ~0.15 ms less a sync
        self._conn.execute("PRAGMA temp_store=MEMORY")
        # a sync's writes land on leaves the next syncs touch again: a page cache that holds the
        # hot leaves (the default is 2 MiB) and checkpoints 4x rarer than the default (each copies
        # a page once however often it was written since): ~0.07 ms less CPU a sync
        self._conn.execute(f"PRAGMA cache_size={-CACHE_KIB}")
        self._conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
        self.changes = counters.Changes()
        """Cells the triggers touched since a reader last took them (store/counters.py)."""
        self._conn.create_function("cell_changed", 1, self.changes.mark, deterministic=False)
        had_backlog = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='token_backlog'").fetchone() is not None
        self._conn.executescript(SCHEMA + counters.CHANGES_SCHEMA)
        self._add_missing_columns()
        self._depth = 0
        self._durable = True
        self.fleet = fleet.FleetStore(self)
        self.owners = owners.OwnerStore(self)
        self.sessions = sessions.SessionStore(self)
        self.context = session_context.ContextStore(self, self.sessions.token_ids)
        self.tokens = tokens.TokenStore(self)
        self.export = exportread.ExportReader(self)
        self.retention = retention.RetentionStore(self)
        self.messages = messages.MessageStore(self)
        self.jobs = jobs.JobStore(self)
        migrate_legacy(self)  # a store of the per-token layout: converted once, in place
        if not had_backlog:  # a store of chunks written before the backlog was kept by triggers
            rebuild_backlog(self)
        counters.rebuild(self)  # kept by triggers; recounted here so any store file starts right

    @contextmanager
    def tx(self, durable: bool = True) -> Iterator[None]:
        """One atomic transaction; nested calls join the outermost (whose durability wins)."""
        if self._depth:
            assert self._durable or not durable, "a durable write nested in a non-durable transaction"
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if durable != self._durable:
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._durable = durable
        self._conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        self.changes.begin()
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            self.changes.undo()
            raise
        else:
            self._conn.execute("COMMIT")
            self.changes.commit()
        finally:
            self._depth = 0

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A part of the open transaction undone alone if it raises (what came before it stays;
        the exception goes on). The cells it named stay named: a reader re-reads them."""
        assert self._depth, "a savepoint belongs inside a transaction"
        self._conn.execute("SAVEPOINT part")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK TO part")
            self._conn.execute("RELEASE part")
            raise
        else:
            self._conn.execute("RELEASE part")

    def _add_missing_columns(self) -> None:
        for table, column, decl in ADDED_COLUMNS:
            have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def execute(self, sql: str, params: tuple | list = ()) -> sqlite3.Cursor:
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: list) -> sqlite3.Cursor:
        return self._conn.executemany(sql, rows)

    def take_over_checkpoints(self) -> Checkpointer:
        """Stop the automatic checkpoints this connection's commits ran inline (~30 ms each under
        a fleet's writes, on the loop's thread); returns what the caller runs instead, on a
        worker thread (scheduler/control/durability.py)."""
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        return Checkpointer(self.path)

    def close(self) -> None:
        self._conn.close()


class Checkpointer:
    """Passive checkpoints of a store's WAL on a connection of its own: they copy the frames no
    reader needs into the database file without waiting for, or holding up, the writer; the
    writer starts the WAL over once one has copied them all. Use it from one thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def __call__(self) -> tuple[int, int, int]:
        """(busy, frames in the WAL, frames copied)."""
        if self._conn is None:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        return tuple(self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

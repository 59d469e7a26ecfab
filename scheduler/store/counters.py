"""Per-cell load and per-state request counts, kept by triggers on `requests` and `migrations`.

`cell_load` holds, per cell: its live (running or migrating) requests, their context tokens
(`base - prompt_start + num_generated`), the pending migrations headed to it and the requests
it holds (live or parked); `request_counts`
holds the requests in each state. Triggers change them in the same statement (so the same
transaction, rolled back with it) as the row that moves them, so the planner's snapshot and the
cell views read one small row per cell instead of grouping the live requests each time.
Temporary triggers (`CHANGES_SCHEMA`) name every cell a write touched to `cell_changed` (a
function of the connection, `Changes`), so a reader that keeps per-cell values between reads re-reads only those cells.
`rebuild` recounts both from the tables (on every open: a store written before the counters
existed, or edited by hand, starts right); `recount` is the full count, for checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.store.base import Database

_LIVE = "('running', 'migrating')"
_OWNED = "('running', 'migrating', 'parked')"
_TOKENS = "{r}.base - {r}.prompt_start + {r}.num_generated"


def _req_enter(r: str) -> str:
    live = f"({r}.state IN {_LIVE})"
    return (f"INSERT INTO cell_load(cell_id, live, tokens, owned) SELECT {r}.cell_id, {live}, "
            f"{live} * ({_TOKENS.format(r=r)}), 1 WHERE {r}.cell_id IS NOT NULL AND {r}.state IN {_OWNED} "
            "ON CONFLICT(cell_id) DO UPDATE SET live = live + excluded.live, "
            "tokens = tokens + excluded.tokens, owned = owned + 1;\n"
            f"INSERT INTO request_counts(state, n) VALUES ({r}.state, 1) "
            "ON CONFLICT(state) DO UPDATE SET n = n + 1;")


def _req_leave(r: str) -> str:
    live = f"({r}.state IN {_LIVE})"
    return (f"UPDATE cell_load SET live = live - {live}, tokens = tokens - {live} * ({_TOKENS.format(r=r)}), "
            f"owned = owned - 1 WHERE cell_id = {r}.cell_id AND {r}.state IN {_OWNED};\n"
            f"UPDATE request_counts SET n = n - 1 WHERE state = {r}.state;")


def _mig_enter(r: str) -> str:
    return (f"INSERT INTO cell_load(cell_id, incoming) SELECT {r}.dst, 1 WHERE {r}.state = 'pending' "
            "ON CONFLICT(cell_id) DO UPDATE SET incoming = incoming + 1;")


def _mig_leave(r: str) -> str:
    return f"UPDATE cell_load SET incoming = incoming - 1 WHERE cell_id = {r}.dst AND {r}.state = 'pending';"


_REQ_MOVES = "UPDATE OF cell_id, state, base, prompt_start, num_generated ON requests"
_SAME_PLACE = ("(OLD.cell_id IS NEW.cell_id AND OLD.state IS NEW.state AND OLD.base IS NEW.base"
               " AND OLD.prompt_start IS NEW.prompt_start)")
"""A request that only grew (a sync's tokens): `requests_count_grow` adds the new tokens to its
cell's count in one statement instead of the leave-and-enter of a move."""
_MIG_MOVES = "UPDATE OF dst, state ON migrations"

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS cell_load(
  cell_id TEXT PRIMARY KEY, live INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
  incoming INTEGER NOT NULL DEFAULT 0, owned INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS request_counts(state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS requests_count_ins AFTER INSERT ON requests BEGIN {_req_enter("NEW")} END;
CREATE TRIGGER IF NOT EXISTS requests_count_del AFTER DELETE ON requests BEGIN {_req_leave("OLD")} END;
DROP TRIGGER IF EXISTS requests_count_upd;
CREATE TRIGGER IF NOT EXISTS requests_count_move AFTER {_REQ_MOVES} WHEN NOT {_SAME_PLACE} BEGIN
  {_req_leave("OLD")}
  {_req_enter("NEW")}
END;
CREATE TRIGGER IF NOT EXISTS requests_count_grow AFTER UPDATE OF num_generated ON requests
  WHEN {_SAME_PLACE} AND NEW.num_generated != OLD.num_generated AND NEW.state IN {_LIVE} BEGIN
  UPDATE cell_load SET tokens = tokens + NEW.num_generated - OLD.num_generated WHERE cell_id = NEW.cell_id;
END;
CREATE TRIGGER IF NOT EXISTS migrations_count_ins AFTER INSERT ON migrations BEGIN {_mig_enter("NEW")} END;
CREATE TRIGGER IF NOT EXISTS migrations_count_del AFTER DELETE ON migrations BEGIN {_mig_leave("OLD")} END;
CREATE TRIGGER IF NOT EXISTS migrations_count_upd AFTER {_MIG_MOVES} BEGIN
  {_mig_leave("OLD")}
  {_mig_enter("NEW")}
END;
"""


def _marks(name: str, table: str, col: str, moves: str) -> str:
    return (f"CREATE TEMP TRIGGER IF NOT EXISTS {name}_ins AFTER INSERT ON main.{table} "
            f"BEGIN SELECT cell_changed(NEW.{col}); END;\n"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {name}_del AFTER DELETE ON main.{table} "
            f"BEGIN SELECT cell_changed(OLD.{col}); END;\n"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {name}_upd AFTER {moves} WHEN OLD.{col} IS NOT NEW.{col} "
            f"BEGIN SELECT cell_changed(OLD.{col}); SELECT cell_changed(NEW.{col}); END;\n"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {name}_upd1 AFTER {moves} WHEN OLD.{col} IS NEW.{col} "
            f"BEGIN SELECT cell_changed(NEW.{col}); END;\n")


CHANGES_SCHEMA = (_marks("requests_changed", "requests", "cell_id", _REQ_MOVES.replace("ON ", "ON main."))
                  + _marks("migrations_changed", "migrations", "dst", _MIG_MOVES.replace("ON ", "ON main."))
                  + _marks("cells_changed", "cells", "id", "UPDATE ON main.cells"))
"""Temporary triggers (this connection only: they call its `cell_changed`, so a second
connection to the file writes without them) that name every cell a write touched."""

_RECOUNT_LOAD = f"""
SELECT cell_id, SUM(live), SUM(tokens), SUM(incoming), SUM(owned) FROM (
  SELECT cell_id, state IN {_LIVE} AS live, (state IN {_LIVE}) * ({_TOKENS.format(r="requests")}) AS tokens,
    0 AS incoming, 1 AS owned FROM requests WHERE state IN {_OWNED} AND cell_id IS NOT NULL
  UNION ALL
  SELECT dst, 0, 0, 1, 0 FROM migrations WHERE state = 'pending')
GROUP BY cell_id"""


def recount(store: Database) -> tuple[dict[str, tuple[int, int, int, int]], dict[str, int]]:
    """Both counters from a full read of the tables: ({cell: (live, tokens, incoming, owned)},
    {state: requests}); cells and states with nothing are left out."""
    load = {c: (int(n), int(t or 0), int(i), int(o)) for c, n, t, i, o in store.execute(_RECOUNT_LOAD)}
    states = dict(store.execute("SELECT state, COUNT(*) FROM requests GROUP BY state").fetchall())
    return load, states


def stored(store: Database) -> tuple[dict[str, tuple[int, int, int, int]], dict[str, int]]:
    """Both counters as kept, in `recount`'s form (zero rows left out)."""
    q = ("SELECT cell_id, live, tokens, incoming, owned FROM cell_load "
         "WHERE live != 0 OR tokens != 0 OR incoming != 0 OR owned != 0")
    load = {c: (n, t, i, o) for c, n, t, i, o in store.execute(q)}
    states = dict(store.execute("SELECT state, n FROM request_counts WHERE n != 0").fetchall())
    return load, states


def rebuild(store: Database) -> None:
    """Recount both counters from the tables, in one transaction."""
    load, states = recount(store)
    with store.tx(durable=True):
        store.execute("DELETE FROM cell_load")
        store.executemany("INSERT INTO cell_load(cell_id, live, tokens, incoming, owned) VALUES (?,?,?,?,?)",
                          [(c, *v) for c, v in load.items()])
        store.execute("DELETE FROM request_counts")
        store.executemany("INSERT INTO request_counts(state, n) VALUES (?,?)", list(states.items()))


class Changes:
    """Cells named by the triggers, for each reader since its last `take` (in memory, not
    durable). A reader may have read rows inside a transaction that was then undone: the cells
    that transaction named are named again to every reader when it rolls back (`undo`), so
    they are re-read as the rollback left them — a rollback costs a re-read of what it
    touched, not of the whole fleet. `rollbacks` counts the rollbacks (a reader that keeps
    values of another kind may rebuild on it)."""

    def __init__(self) -> None:
        self.sinks: list[set[str]] = []
        self.rollbacks = 0
        self.in_tx: set[str] | None = None
        """Cells named inside the open transaction (None: none open)."""

    def reader(self) -> ChangeReader:
        sink: set[str] = set()
        self.sinks.append(sink)
        return ChangeReader(self, sink)

    def mark(self, cell_id: str | None) -> None:
        if cell_id is not None:
            for sink in self.sinks:
                sink.add(cell_id)
            if self.in_tx is not None:
                self.in_tx.add(cell_id)

    def begin(self) -> None:
        self.in_tx = set()

    def commit(self) -> None:
        self.in_tx = None

    def undo(self) -> None:
        """The open transaction rolled back: name its cells again to every reader."""
        touched, self.in_tx = self.in_tx or set(), None
        for sink in self.sinks:
            sink |= touched


class ChangeReader:
    """One reader's view of `Changes`."""

    def __init__(self, changes: Changes, sink: set[str]) -> None:
        self.changes = changes
        self.sink = sink
        self.slot = next(k for k, x in enumerate(changes.sinks) if x is sink)
        """Its sink's place in `changes.sinks`."""

    @property
    def rollbacks(self) -> int:
        return self.changes.rollbacks

    def take(self) -> set[str]:
        """The cells named since the last take (the reader's own set from now on: no copy)."""
        out = self.sink
        self.sink = self.changes.sinks[self.slot] = set()
        return out

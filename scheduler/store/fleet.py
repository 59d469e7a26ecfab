"""Store tables of the fleet: cells, flips, weight versions, idempotency keys and settings.

Rows are plain dataclasses; `put_*` writes a whole row (callers mutate a row they read in the
same transaction, through `states.set_state` for the state column).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from scheduler.contract.states import role_of
from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS cells(
  id TEXT PRIMARY KEY, incarnation TEXT NOT NULL, state TEXT NOT NULL,
  generation INTEGER NOT NULL, version INTEGER, address TEXT NOT NULL, store_port INTEGER NOT NULL,
  capabilities TEXT NOT NULL, kv_blocks_total INTEGER NOT NULL, kv_blocks_used INTEGER NOT NULL,
  max_running INTEGER NOT NULL, history TEXT NOT NULL, trust TEXT NOT NULL DEFAULT 'unverified', probe TEXT);
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
CREATE TABLE IF NOT EXISTS settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

ACTIVE_FLIP_STATES = ("pending", "draining", "loading")


class SyncView(NamedTuple):
    """What a sync checks and compares of its cell's row (`sync_view`): no JSON column decoded."""

    id: str
    incarnation: str
    state: str
    version: int | None
    kv_blocks_total: int


class PlanningRow(NamedTuple):
    """A cell as the planner's snapshot and the fleet's tally read it (`planning_rows`)."""

    cell_id: str
    state: str
    generation: int
    version: int | None
    address: str
    capabilities: dict[str, Any]
    """A shared decoded copy: read it, never change it."""
    kv_blocks_total: int
    kv_blocks_used: int
    max_running: int
    live: int
    """Requests the cell owns (store/counters.py)."""
    tokens: int
    """Context tokens of those requests."""
    incoming: int
    """Requests migrating in."""
    trust: str
    probed: int
    """1: it registered with a probe answer."""


_row = tuple.__new__
"""Builds a `PlanningRow` from a tuple without the Python-level constructor (a hot loop)."""


@dataclass(slots=True)
class CellRow:
    id: str
    incarnation: str
    state: str
    generation: int
    version: int | None
    address: str
    store_port: int
    capabilities: dict[str, Any]
    kv_blocks_total: int
    kv_blocks_used: int
    max_running: int
    history: list = field(default_factory=list)
    trust: str = "unverified"
    """`unverified` (registered, not yet shown to run the model), `verified` (its registration
    probe agreed with the version's reference) or `quarantined` (fenced for what it reported:
    scheduler/control/trust.py)."""
    probe: dict | None = None
    """This incarnation's registration probe: {"version", "logprobs", "exact"}."""

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id, "incarnation": self.incarnation, "state": self.state,
            "role": role_of(self.state), "generation": self.generation, "version": self.version,
            "address": self.address, "store_port": self.store_port,
            "capabilities": self.capabilities, "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_total": self.kv_blocks_total, "max_running": self.max_running, "trust": self.trust,
        }


@dataclass(slots=True)
class FlipRow:
    id: str
    cell_id: str
    to_role: str
    state: str
    idem_key: str | None = None
    reason: str | None = None
    migrated: int = 0
    suspended: int = 0
    recomputed: int = 0
    created_at: float = 0.0
    finished_at: float | None = None
    history: list = field(default_factory=list)
    kv_store: int = 0
    """Requests moved by the `kv_store` path (the destination loaded the shared prefix);
    `migrated` counts KV copies, `recomputed` re-prefills."""

    def to_api(self, now: float | None = None) -> dict[str, Any]:
        end = self.finished_at if self.finished_at is not None else (now or time.time())
        return {
            "id": self.id, "cell": self.cell_id, "to": self.to_role, "state": self.state,
            "migrated": self.migrated, "kv_store": self.kv_store, "suspended": self.suspended,
            "recomputed": self.recomputed,
            "duration_s": max(0.0, end - self.created_at), "reason": self.reason,
            "history": [list(h) for h in self.history],
        }


@dataclass(slots=True)
class VersionRow:
    v: int
    state: str
    created_at: float
    history: list = field(default_factory=list)
    source: dict | None = None
    """Where cells fetch the weights: the trainer's version host {"host", "port", "namespace"}
    (None: the version is recorded only, cells load it by other means)."""


_CELL_COLS = ("id, incarnation, state, generation, version, address, store_port, capabilities, kv_blocks_total, "
              "kv_blocks_used, max_running, history, trust, probe")
_FLIP_COLS = ("id, cell_id, to_role, state, idem_key, reason, migrated, suspended, recomputed, created_at, "
              "finished_at, history, kv_store")


def _version(r: tuple) -> VersionRow:
    return VersionRow(r[0], r[1], r[2], loads(r[3]), loads(r[4]) if r[4] else None)


def _cell(r: tuple) -> CellRow:
    return CellRow(*r[:7], loads(r[7]), *r[8:11], loads(r[11]), r[12], loads(r[13]) if r[13] else None)


def _flip(r: tuple) -> FlipRow:
    return FlipRow(*r[:11], loads(r[11]), r[12])


class FleetStore:
    def __init__(self, store: Database) -> None:
        self.s = store
        self._caps: dict[str, dict[str, Any]] = {}
        """Decoded capabilities by their JSON text (most cells' texts repeat tick to tick)."""
        self._changes = store.changes.reader()
        self._rollbacks = -1
        self._rows: dict[str, CellRow] = {}
        self._order: list[str] = []
        self._listed: list[CellRow] = []
        self._plan_changes = store.changes.reader()
        self._planning: dict[str, PlanningRow] | None = None
        """Kept planning rows of the not-down cells (None: not read yet)."""

    # -- cells
    def sync_view(self, cell_id: str) -> SyncView | None:
        """The cell's row as a sync reads it (`SyncView`), without its capabilities, history or
        probe (JSON the sync never reads)."""
        r = self.s.execute("SELECT id, incarnation, state, version, kv_blocks_total FROM cells WHERE id=?",
                           (cell_id,)).fetchone()
        return None if r is None else SyncView._make(r)

    def get_cell(self, cell_id: str) -> CellRow | None:
        r = self.s.execute(f"SELECT {_CELL_COLS} FROM cells WHERE id=?", (cell_id,)).fetchone()
        return None if r is None else _cell(r)

    def list_cells(self) -> list[CellRow]:
        """Every cell in id order: rows kept decoded between calls and re-read only where the
        store's triggers saw a write (store/counters.py), all of them after a rollback. Shared
        rows: read them, never change them (`get_cell` gives a row of one's own to change)."""
        changed: set[str] | None = self._changes.take()
        if self._changes.rollbacks != self._rollbacks:
            self._rollbacks, changed = self._changes.rollbacks, None
        elif not changed:
            return list(self._listed)
        rows = self._rows = {} if changed is None else self._rows
        was = {cid for cid in changed if rows.pop(cid, None) is not None} if changed is not None else None
        ids = list(changed) if changed is not None else None
        for k in range(0, len(ids), 500) if ids is not None else (None,):
            part = ids[k:k + 500] if ids is not None else ()
            where = f" WHERE id IN ({','.join('?' * len(part))})" if ids is not None else ""
            for r in self.s.execute(f"SELECT {_CELL_COLS} FROM cells{where}", part):
                rows[r[0]] = _cell(r)
        if changed is None or was != {cid for cid in changed if cid in rows}:
            self._order = sorted(rows)  # cells came or went
        self._listed = [rows[k] for k in self._order]
        return list(self._listed)

    def page_cells(self, after: str | None, limit: int) -> list[CellRow]:
        """Up to `limit` cells with ids after `after` (None: from the first), in id order."""
        q = f"SELECT {_CELL_COLS} FROM cells WHERE id > ? ORDER BY id LIMIT ?"
        return [_cell(r) for r in self.s.execute(q, ("" if after is None else after, limit))]

    def planning_rows(self, ids: Collection[str] | None = None) -> list[PlanningRow]:
        """The cells `ids` (None: all) that are not down, with their kept load (store/counters.py),
        for the planner's snapshot, the fleet's tally and the served versions. Kept between
        calls and re-read only where the store's triggers named a cell since (every reader of a
        tick shares one read of what changed; when more than half the kept cells changed, one
        read of the whole table, which costs less than the same rows by id). No history; rows
        and their `capabilities` are shared: read them, never change them."""
        kept = self._planning
        changed = self._plan_changes.take()
        if kept is None or len(changed) > len(kept) // 2:  # one pass over the table beats id lists
            kept = self._planning = {r.cell_id: r for r in self._read_planning(None)}
        elif changed:
            for cid in changed:
                kept.pop(cid, None)
            kept.update((r.cell_id, r) for r in self._read_planning(changed))
        if ids is None:
            return list(kept.values())
        return [r for i in ids if (r := kept.get(i)) is not None]

    def _read_planning(self, ids: Collection[str] | None) -> list[PlanningRow]:
        q = ("SELECT c.id, c.state, c.generation, c.version, c.address, c.capabilities, c.kv_blocks_total, "
             "c.kv_blocks_used, c.max_running, COALESCE(l.live, 0), COALESCE(l.tokens, 0), "
             "COALESCE(l.incoming, 0), c.trust, c.probe IS NOT NULL FROM cells c "
             "LEFT JOIN cell_load l ON l.cell_id = c.id "
             "WHERE c.state != 'down'")
        if ids is None:
            rows = self.s.execute(q).fetchall()
        else:
            wanted, rows = list(ids), []
            for k in range(0, len(wanted), 500):
                part = wanted[k:k + 500]
                rows += self.s.execute(f"{q} AND c.id IN ({','.join('?' * len(part))})", part).fetchall()
        memo = self._caps
        if len(memo) > 65536:  # texts of cells that changed or left
            memo.clear()
        for i, (cid, state, generation, version, address, text, *rest) in enumerate(rows):
            caps = memo.get(text)
            if caps is None:
                caps = memo[text] = loads(text)
            rows[i] = _row(PlanningRow, (cid, state, generation, version, address, caps, *rest))
        return rows

    def cell_states(self, ids: Collection[str] | None = None) -> dict[str, str]:
        """id → state of the cells `ids` (None: every cell), without decoding whole rows."""
        if ids is None:
            return dict(self.s.execute("SELECT id, state FROM cells"))
        wanted, out = list(ids), {}
        for k in range(0, len(wanted), 500):
            part = wanted[k:k + 500]
            out.update(self.s.execute(f"SELECT id, state FROM cells WHERE id IN ({','.join('?' * len(part))})", part))
        return out

    def put_cell(self, c: CellRow) -> None:
        self.s.execute(
            f"INSERT OR REPLACE INTO cells({_CELL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (c.id, c.incarnation, c.state, c.generation, c.version, c.address, c.store_port,
             dumps(c.capabilities), c.kv_blocks_total, c.kv_blocks_used, c.max_running, dumps(c.history[-50:]),
             c.trust, dumps(c.probe) if c.probe is not None else None),
        )

    # -- flips
    def get_flip(self, flip_id: str) -> FlipRow | None:
        r = self.s.execute(f"SELECT {_FLIP_COLS} FROM flips WHERE id=?", (flip_id,)).fetchone()
        return None if r is None else _flip(r)

    def list_flips(self, active_only: bool = False, limit: int = 100) -> list[FlipRow]:
        if active_only:
            q = f"SELECT {_FLIP_COLS} FROM flips WHERE state IN (?,?,?) ORDER BY created_at, id"
            return [_flip(r) for r in self.s.execute(q, ACTIVE_FLIP_STATES)]
        q = f"SELECT {_FLIP_COLS} FROM flips ORDER BY created_at DESC, id LIMIT ?"
        return [_flip(r) for r in self.s.execute(q, (limit,))]

    def flipping_cells(self, to_role: str | None = None) -> set[str]:
        """Cells with a flip under way (to `to_role` only, when given): ids only, nothing decoded."""
        q = "SELECT cell_id FROM flips WHERE state IN (?,?,?)"
        args: tuple = ACTIVE_FLIP_STATES
        if to_role is not None:
            q, args = q + " AND to_role = ?", (*args, to_role)
        return {r[0] for r in self.s.execute(q, args)}

    def active_flip_for(self, cell_id: str) -> FlipRow | None:
        q = f"SELECT {_FLIP_COLS} FROM flips WHERE cell_id=? AND state IN (?,?,?)"
        r = self.s.execute(q, (cell_id, *ACTIVE_FLIP_STATES)).fetchone()
        return None if r is None else _flip(r)

    def put_flip(self, f: FlipRow) -> None:
        self.s.execute(
            f"INSERT OR REPLACE INTO flips({_FLIP_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (f.id, f.cell_id, f.to_role, f.state, f.idem_key, f.reason, f.migrated, f.suspended,
             f.recomputed, f.created_at, f.finished_at, dumps(f.history), f.kv_store),
        )

    # -- versions
    def get_version(self, v: int) -> VersionRow | None:
        r = self.s.execute("SELECT v, state, created_at, history, source FROM versions WHERE v=?", (v,)).fetchone()
        return None if r is None else _version(r)

    def list_versions(self) -> list[VersionRow]:
        rows = self.s.execute("SELECT v, state, created_at, history, source FROM versions ORDER BY v")
        return [_version(r) for r in rows]

    def published_among(self, versions: Collection[int]) -> set[int]:
        """Those of `versions` that were ever published (a row each: one indexed look-up a
        version, however many the store holds)."""
        vs, out = [v for v in versions if type(v) is int and -(1 << 63) <= v < 1 << 63], set()
        for k in range(0, len(vs), 500):
            part = vs[k:k + 500]
            out.update(v for (v,) in self.s.execute(f"SELECT v FROM versions WHERE v IN ({','.join('?' * len(part))})",
                                                     part))
        return out

    def put_version(self, row: VersionRow) -> None:
        self.s.execute(
            "INSERT OR REPLACE INTO versions(v, state, created_at, history, source) VALUES (?,?,?,?,?)",
            (row.v, row.state, row.created_at, dumps(row.history), dumps(row.source) if row.source else None),
        )

    # -- settings (small durable facts: the trainer's version host)
    def setting(self, key: str) -> Any:
        r = self.s.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return None if r is None else loads(r[0])

    def put_setting(self, key: str, value: Any) -> None:
        self.s.execute("INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)", (key, dumps(value)))

    # -- idempotency keys
    def get_idempotent(self, scope: str, key: str) -> tuple[str, Any] | None:
        """(fingerprint of the first request, its response) for a key seen before."""
        q = "SELECT fingerprint, response FROM idempotency WHERE scope=? AND key=?"
        r = self.s.execute(q, (scope, key)).fetchone()
        return None if r is None else (r[0], loads(r[1]))

    def expire_idempotent(self, before: float) -> int:
        """Forget keys recorded before `before` (wall clock); returns how many."""
        return self.s.execute("DELETE FROM idempotency WHERE created_at < ?", (before,)).rowcount

    def put_idempotent(self, scope: str, key: str, fingerprint: str, response: Any) -> None:
        self.s.execute(
            "INSERT INTO idempotency(scope, key, fingerprint, response, created_at) VALUES (?,?,?,?,?)",
            (scope, key, fingerprint, dumps(response), time.time()),
        )

"""Store tables of ownership: requests (owner cell + epoch) and migrations.

A request's generated token i lives at index `base + i` of its session's token buffer; its
context (what a `start` command re-prefills) is the buffer from `prompt_start` up to
`base + num_generated`. Ownership changes only through this module's rows, inside
`Store.tx(durable=True)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.contract.sampling import SamplingParams
from scheduler.store import counters
from scheduler.store.base import update_by_key
from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
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
  src_state TEXT NOT NULL DEFAULT 'running', commit_tokens INTEGER, stall_s REAL);
CREATE INDEX IF NOT EXISTS migrations_state ON migrations(state, request_id);
CREATE TABLE IF NOT EXISTS foreign_batches(
  request_id TEXT NOT NULL, cell_id TEXT NOT NULL, epoch INTEGER NOT NULL, owner TEXT,
  owner_epoch INTEGER NOT NULL, start INTEGER NOT NULL, count INTEGER NOT NULL,
  new INTEGER NOT NULL, at REAL NOT NULL);
""" + counters.SCHEMA

LIVE_REQUEST_STATES = ("running", "migrating")
"""Decoding (or moving) on their owner: what a cell's load and a drain count."""
OWNED_REQUEST_STATES = (*LIVE_REQUEST_STATES, "parked")
"""Held by a cell: live ones, and parked ones whose KV waits in the owner's host memory."""
WAITING_REQUEST_STATES = ("queued", "suspended")


@dataclass(slots=True)
class RequestRow:
    id: str
    session_id: str
    base: int
    prompt_start: int
    num_generated: int
    params: dict[str, Any]
    """The request's `SamplingParams` as its JSON column holds them (`sampling()` reads them)."""
    cell_id: str | None
    epoch: int
    state: str
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(self.params)

    @property
    def is_owned(self) -> bool:
        return self.state in OWNED_REQUEST_STATES

    @property
    def num_tokens(self) -> int:
        """Context length: prompt plus generated so far."""
        return self.base - self.prompt_start + self.num_generated


@dataclass(slots=True)
class MigrationRow:
    id: str
    request_id: str
    src: str
    dst: str
    epoch: int
    state: str
    path: str
    flip_id: str | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    history: list = field(default_factory=list)
    src_state: str = "running"
    """The request's state before the move ("running", or "parked" for a move out of a parked
    copy): where an aborted migration puts it back."""
    commit_tokens: int | None = None
    """Generated tokens stored when the commit moved the owner (the tail included): every
    sampled token of the request past it was written at a later epoch (the store's own
    history of the fence; faultkit's checker reads it)."""


_REQ_COLS = "id, session_id, base, prompt_start, num_generated, params, cell_id, epoch, state, reason, created_at, updated_at"
_MIG_COLS = ("id, request_id, src, dst, epoch, state, path, flip_id, reason, created_at, finished_at, history, src_state,"
             " commit_tokens")


def _upsert(cols: str) -> str:
    """An update in place of an existing row (not REPLACE's delete and insert), so the counter
    triggers see one change: the old row leaves the counts, the new one enters them."""
    rest = [c.strip() for c in cols.split(",")][1:]
    return "ON CONFLICT(id) DO UPDATE SET " + ", ".join(f"{c}=excluded.{c}" for c in rest)


_REQ_UPSERT = _upsert(_REQ_COLS)
_MIG_UPSERT = _upsert(_MIG_COLS)


class _Unread:
    """The params of a row read without them (`get_requests(params=False)`): not a mapping, not
    JSON, not `SamplingParams`: any use of them fails loudly instead of reading `{}`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREAD"


UNREAD: Any = _Unread()
"""`RequestRow.params` of a row read without them."""


_FOR_TOKENS = ("SELECT r.id, r.session_id, r.base, r.prompt_start, r.num_generated, r.cell_id, r.epoch, r.state,"
               " r.reason, r.created_at, r.updated_at, s.length FROM requests r LEFT JOIN sessions s"
               " ON s.id = r.session_id WHERE r.id IN ({})")


def _req(r: tuple) -> RequestRow:
    return RequestRow(*r[:5], loads(r[5]), *r[6:])


def _mig(r: tuple) -> MigrationRow:
    return MigrationRow(*r[:11], loads(r[11]), r[12], r[13])


class OwnerStore:
    def __init__(self, store: Database) -> None:
        self.s = store

    # -- requests
    def get_request(self, request_id: str) -> RequestRow | None:
        r = self.s.execute(f"SELECT {_REQ_COLS} FROM requests WHERE id=?", (request_id,)).fetchone()
        return None if r is None else _req(r)

    def get_requests(self, request_ids: list[str], params: bool = True) -> dict[str, RequestRow]:
        """id → row of those of `request_ids` that exist (one read for a sync's batches).
        `params=False`: the sampling params are not decoded (a sync's token batches never read
        them: 32 JSON decodes a sync saved); such a row's `params` is `UNREAD`, which no code
        can write back (`put_request` refuses it) or read a value from."""
        out: dict[str, RequestRow] = {}
        for k in range(0, len(request_ids), 500):
            part = request_ids[k:k + 500]
            q = f"SELECT {_REQ_COLS} FROM requests WHERE id IN ({','.join('?' * len(part))})"
            if params:
                out.update((r[0], _req(r)) for r in self.s.execute(q, part))
            else:
                out.update((r[0], RequestRow(*r[:5], UNREAD, *r[6:])) for r in self.s.execute(q, part))
        return out

    def for_tokens(self, request_ids: list[str]) -> tuple[dict[str, RequestRow], dict[str, int]]:
        """What a sync's token batches are judged against, in one read: id → row of those of
        `request_ids` that exist, read without their params (`get_requests(params=False)`), and
        session → its buffer's length for their sessions."""
        reqs: dict[str, RequestRow] = {}
        lengths: dict[str, int] = {}
        for k in range(0, len(request_ids), 500):
            part = request_ids[k:k + 500]
            q = _FOR_TOKENS.format(",".join("?" * len(part)))
            for i, sid, base, ps, ng, cell, epoch, state, reason, created, updated, n in self.s.execute(q, part):
                reqs[i] = RequestRow(i, sid, base, ps, ng, UNREAD, cell, epoch, state, reason, created, updated)
                if n is not None:
                    lengths[sid] = n
        return reqs, lengths

    def put_request(self, q: RequestRow) -> None:
        if q.params is UNREAD:
            raise ValueError(f"request {q.id} was read without its params: read it whole to write it")
        q.updated_at = time.time()
        self.s.execute(
            f"INSERT INTO requests({_REQ_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) {_REQ_UPSERT}",
            (q.id, q.session_id, q.base, q.prompt_start, q.num_generated, dumps(q.params), q.cell_id,
             q.epoch, q.state, q.reason, q.created_at, q.updated_at),
        )

    def record_foreign_batch(self, req: RequestRow, cell_id: str, epoch: int, start: int, count: int,
                             new: int) -> None:
        """A token batch the store took from a cell that is not the request's owner at its
        epoch (even one that added nothing: a duplicate). The fence refuses these, so a row
        here means the fence was off or broken; faultkit's checker reports every row."""
        self.s.execute("INSERT INTO foreign_batches VALUES (?,?,?,?,?,?,?,?,?)",
                       (req.id, cell_id, epoch, req.cell_id, req.epoch, start, count, new, time.time()))

    def set_num_generated(self, request_id: str, n: int) -> None:
        self.s.execute("UPDATE requests SET num_generated=?, updated_at=? WHERE id=?", (n, time.time(), request_id))

    def set_num_generated_many(self, counts: list[tuple[str, int]]) -> None:
        """(request id, tokens generated) for many requests (distinct), in one statement."""
        update_by_key(self.s, "requests", "id", ("num_generated",), counts, "updated_at = ?", (time.time(),))

    def requests_on(self, cell_id: str, states: tuple[str, ...] = LIVE_REQUEST_STATES) -> list[RequestRow]:
        marks = ",".join("?" * len(states))
        q = f"SELECT {_REQ_COLS} FROM requests WHERE cell_id=? AND state IN ({marks}) ORDER BY created_at, id"
        return [_req(r) for r in self.s.execute(q, (cell_id, *states))]

    def owned_states(self, cell_id: str) -> dict[str, str]:
        """id → state of the requests `cell_id` holds (running, migrating or parked): ids only,
        nothing decoded (the owners' report sweep compares them with what the cell reports)."""
        marks = ",".join("?" * len(OWNED_REQUEST_STATES))
        q = f"SELECT id, state FROM requests WHERE cell_id=? AND state IN ({marks})"
        return dict(self.s.execute(q, (cell_id, *OWNED_REQUEST_STATES)).fetchall())

    def requests_in(self, states: tuple[str, ...], limit: int = 1000) -> list[RequestRow]:
        marks = ",".join("?" * len(states))
        q = f"SELECT {_REQ_COLS} FROM requests WHERE state IN ({marks}) ORDER BY created_at, id LIMIT ?"
        return [_req(r) for r in self.s.execute(q, (*states, limit))]

    def live_counts(self, first: str | None = None, last: str | None = None) -> dict[str, int]:
        """Live (running or migrating) requests per owner cell (kept counts, store/counters.py);
        with `first` and `last`, only the cells whose ids lie between them (inclusive)."""
        if first is None or last is None:
            return dict(self.s.execute("SELECT cell_id, live FROM cell_load WHERE live > 0").fetchall())
        q = "SELECT cell_id, live FROM cell_load WHERE cell_id BETWEEN ? AND ? AND live > 0"
        return dict(self.s.execute(q, (first, last)).fetchall())

    def live_load(self) -> dict[str, tuple[int, int]]:
        """Live requests and their context tokens per owner cell: the kept counts
        (store/counters.py), one row per cell, never the requests, sessions or tokens."""
        q = "SELECT cell_id, live, tokens FROM cell_load WHERE live > 0"
        return {c: (n, t) for c, n, t in self.s.execute(q)}

    def owned_counts(self, ids: list[str] | None = None) -> dict[str, int]:
        """Requests each cell holds (running, migrating or parked; kept counts); of the cells
        `ids` only, when given."""
        if ids is None:
            return dict(self.s.execute("SELECT cell_id, owned FROM cell_load WHERE owned > 0").fetchall())
        out: dict[str, int] = {}
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            q = f"SELECT cell_id, owned FROM cell_load WHERE owned > 0 AND cell_id IN ({','.join('?' * len(part))})"
            out.update(self.s.execute(q, part).fetchall())
        return out

    def load_of(self, cell_id: str) -> tuple[int, int, int]:
        """One cell's (live requests, their context tokens, pending migrations headed to it)."""
        q = "SELECT live, tokens, incoming FROM cell_load WHERE cell_id=?"
        r = self.s.execute(q, (cell_id,)).fetchone()
        return (0, 0, 0) if r is None else r

    def active_request_for_session(self, session_id: str) -> RequestRow | None:
        q = f"SELECT {_REQ_COLS} FROM requests WHERE session_id=? AND state NOT IN ('finished','failed') LIMIT 1"
        r = self.s.execute(q, (session_id,)).fetchone()
        return None if r is None else _req(r)

    def has_requests(self, session_id: str) -> bool:
        """Has the session ever had a request (is it a rollout already admitted)?"""
        q = "SELECT 1 FROM requests WHERE session_id=? LIMIT 1"
        return self.s.execute(q, (session_id,)).fetchone() is not None

    def last_cell_for_session(self, session_id: str) -> str | None:
        """The cell that served the session's latest request (where its KV may still be)."""
        q = "SELECT cell_id FROM requests WHERE session_id=? AND cell_id IS NOT NULL ORDER BY created_at DESC LIMIT 1"
        r = self.s.execute(q, (session_id,)).fetchone()
        return None if r is None else r[0]

    def count_waiting(self) -> int:
        """Requests waiting for a cell (queued, suspended or parked): kept counts."""
        q = "SELECT COALESCE(SUM(n), 0) FROM request_counts WHERE state IN ('queued', 'suspended', 'parked')"
        return self.s.execute(q).fetchone()[0]

    def count_requests(self) -> dict[str, int]:
        """Requests per state (kept counts, store/counters.py; states with none left out)."""
        return dict(self.s.execute("SELECT state, n FROM request_counts WHERE n > 0").fetchall())

    # -- migrations
    def get_migration(self, migration_id: str) -> MigrationRow | None:
        r = self.s.execute(f"SELECT {_MIG_COLS} FROM migrations WHERE id=?", (migration_id,)).fetchone()
        return None if r is None else _mig(r)

    def put_migration(self, m: MigrationRow) -> None:
        self.s.execute(
            f"INSERT INTO migrations({_MIG_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) {_MIG_UPSERT}",
            (m.id, m.request_id, m.src, m.dst, m.epoch, m.state, m.path, m.flip_id, m.reason,
             m.created_at, m.finished_at, dumps(m.history), m.src_state, m.commit_tokens),
        )

    def set_migration_stall(self, migration_id: str, seconds: float) -> None:
        """The move's client-visible stall (scheduler/control/stallmeter.py), once measured. Not a
        `MigrationRow` field: only this statement writes it, so no upsert of the row clears it."""
        self.s.execute("UPDATE migrations SET stall_s=? WHERE id=?", (seconds, migration_id))

    def pending_migrations(self) -> list[MigrationRow]:
        q = f"SELECT {_MIG_COLS} FROM migrations WHERE state='pending' ORDER BY created_at, id"
        return [_mig(r) for r in self.s.execute(q)]

    def pending_migration_for(self, request_id: str) -> MigrationRow | None:
        q = f"SELECT {_MIG_COLS} FROM migrations WHERE state='pending' AND request_id=?"
        r = self.s.execute(q, (request_id,)).fetchone()
        return None if r is None else _mig(r)

    def migrations_of_flips(self, flip_ids: list[str]) -> list[MigrationRow]:
        """The migrations the flips `flip_ids` made (a drain's), oldest first."""
        if not flip_ids:
            return []
        marks = ",".join("?" * len(flip_ids))
        q = f"SELECT {_MIG_COLS} FROM migrations WHERE flip_id IN ({marks}) ORDER BY created_at, id"
        return [_mig(r) for r in self.s.execute(q, list(flip_ids))]

    def incoming_pending(self) -> dict[str, int]:
        """Pending migrations per destination cell (their reservations count as load; kept counts)."""
        q = "SELECT cell_id, incoming FROM cell_load WHERE incoming > 0"
        return dict(self.s.execute(q).fetchall())

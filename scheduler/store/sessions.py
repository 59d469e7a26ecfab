"""Session store: each session's token buffer, the source of truth for training data.

Per token: token id, loss mask (1 = sampled by the policy, 0 = prompt / tool output), behavior
log-prob and version, old log-prob and its provenance (`exact`, `missing`, or null while
unscored), and for a sampled token the ownership epoch it was accepted under (the sync batch's,
or the new owner's for a migration commit's tail): with the migrations' commit points, the
store's own history of the epoch fence. Sampled ids are stored exactly as the cell reported
them; nothing here re-encodes. The buffer is stored column-packed, one row per run of tokens
(scheduler/store/tokenbuf.py, scheduler/store/tokenpack.py); every read here gives tokens.
A harness that rewrites earlier turns starts a new *segment* (a fresh sequence in the same
session); `segment_starts` lists where each one begins in the buffer.

Gateway-facing API (no HTTP): `ensure`, `append_prompt`, `new_segment`, `current_segment`,
`read`, and the gateway's own per-session state (`gateway_state`, `put_gateway_state`: a small
JSON object of message fingerprints and turn boundaries, kept beside the buffer). Sampled
tokens arrive only from the cells, through the control plane (`append_sampled`: a sync's
batches, a migration commit's tail).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple

from scheduler.contract.errors import Conflict, NotFound
from scheduler.contract.records import StoredTokens, TokenRecords
from scheduler.store import tokenbuf
from scheduler.store.base import update_by_key
from scheduler.store.codec import dumps, loads
from scheduler.store.tokenpack import prompt_chunk, sampled_chunks, sampled_rows

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions(
  id TEXT PRIMARY KEY, state TEXT NOT NULL, length INTEGER NOT NULL, segment_starts TEXT NOT NULL,
  reward REAL, group_id TEXT, finish_seq INTEGER, created_at REAL NOT NULL, finished_at REAL, agent TEXT,
  tainted INTEGER NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX IF NOT EXISTS sessions_finish ON sessions(finish_seq);
CREATE TABLE IF NOT EXISTS gateway_state(session_id TEXT PRIMARY KEY, state TEXT NOT NULL);
""" + tokenbuf.SCHEMA


@dataclass(slots=True)
class SessionRow:
    id: str
    state: str = "open"
    length: int = 0
    segment_starts: list[int] = field(default_factory=lambda: [0])
    reward: float | None = None
    group_id: str | None = None
    finish_seq: int | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    agent: str | None = None
    """The agent token (its id) that opened the session, the only agent token that may use it;
    None for a session opened by a trainer or admin token (no agent token may use it)."""
    tainted: int = 0
    """1: a quarantined cell sampled some of its tokens; never handed out for training."""


class UnscoredRange(NamedTuple):
    """A request's sampled tokens of one version still without an old log-prob."""

    request_id: str
    session_id: str
    prompt_start: int
    base: int
    num_generated: int
    params: str
    """The request's sampling params (JSON text)."""
    state: str
    owner: str | None
    version: int
    first: int
    """Buffer index of the first unscored token."""
    last: int
    count: int


_SESSION_COLS = ("id, state, length, segment_starts, reward, group_id, finish_seq, created_at, finished_at, agent, "
                 "tainted")


class SessionStore:
    def __init__(self, store: Database) -> None:
        self.s = store
        self.buf = tokenbuf.TokenBuffer(store)
        """The token buffers, column-packed (scheduler/store/tokenbuf.py)."""

    def get(self, session_id: str) -> SessionRow | None:
        r = self.s.execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE id=?", (session_id,)).fetchone()
        return None if r is None else SessionRow(r[0], r[1], r[2], loads(r[3]), *r[4:])

    def require(self, session_id: str, agent: str | None = None) -> SessionRow:
        """The session; 404 when unknown, or when `agent` (an agent token's id) is given and
        the session is not that token's (the same answer: another agent's session does not
        exist for it)."""
        row = self.get(session_id)
        if row is None or (agent is not None and row.agent != agent):
            raise NotFound(f"unknown session {session_id!r}")
        return row

    def put(self, row: SessionRow) -> None:
        self.s.execute(
            f"INSERT OR REPLACE INTO sessions({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (row.id, row.state, row.length, dumps(row.segment_starts), row.reward, row.group_id,
             row.finish_seq, row.created_at, row.finished_at, row.agent, row.tainted),
        )

    def ensure(self, session_id: str, agent: str | None = None) -> SessionRow:
        """The open session `session_id`, created empty if new (owned by `agent`, the agent
        token's id, when given); 409 if it is finished; 404 for an agent token when the session
        is not its own."""
        row = self.get(session_id)
        if row is not None and agent is not None and row.agent != agent:
            raise NotFound(f"unknown session {session_id!r}")
        if row is None:
            row = SessionRow(session_id, agent=agent)
            with self.s.tx(durable=False):
                self.put(row)
        if row.state != "open":
            raise Conflict(f"session {session_id!r} is finished", code="session_finished")
        return row

    def length(self, session_id: str) -> int:
        """Tokens in the session's buffer (0 for an unknown session)."""
        r = self.s.execute("SELECT length FROM sessions WHERE id=?", (session_id,)).fetchone()
        return 0 if r is None else r[0]

    def gateway_state(self, session_id: str) -> dict[str, Any] | None:
        """The chat gateway's state of a session (None before its first turn)."""
        r = self.s.execute("SELECT state FROM gateway_state WHERE session_id=?", (session_id,)).fetchone()
        return None if r is None else loads(r[0])

    def put_gateway_state(self, session_id: str, state: dict[str, Any]) -> None:
        with self.s.tx(durable=False):
            self.s.execute("INSERT OR REPLACE INTO gateway_state(session_id, state) VALUES (?, ?)",
                           (session_id, dumps(state)))

    # -- token buffer
    def read(self, session_id: str, start: int = 0, end: int | None = None) -> StoredTokens:
        """The buffer's tokens [start, end) as columns (scheduler/contract/records.py)."""
        return StoredTokens._wrap(self.buf.columns(session_id, start, end))

    def token_ids(self, session_id: str, start: int = 0, end: int | None = None) -> list[int]:
        return list(self.buf.columns(session_id, start, end)[0])

    def current_segment(self, session_id: str) -> tuple[int, list[int]]:
        row = self.require(session_id)
        start = row.segment_starts[-1]
        return start, self.token_ids(session_id, start)

    def _set_length(self, row: SessionRow, n: int) -> None:
        row.length += n
        self.s.execute("UPDATE sessions SET length=? WHERE id=?", (row.length, row.id))

    def append_prompt(self, session_id: str, token_ids: list[int], agent: str | None = None) -> int:
        """Append prompt/tool tokens (loss mask 0) to the open session; returns the new length."""
        with self.s.tx(durable=False):
            row = self.ensure(session_id, agent)
            if token_ids:
                self.buf.insert([prompt_chunk(row.id, row.length, [int(t) for t in token_ids])])
                self._set_length(row, len(token_ids))
        return row.length

    def new_segment(self, session_id: str, agent: str | None = None) -> int:
        """Start a new segment at the current end (no-op when the current one is empty)."""
        with self.s.tx(durable=False):
            row = self.ensure(session_id, agent)
            if row.segment_starts[-1] != row.length:
                row.segment_starts.append(row.length)
                self.put(row)
        return row.length

    def append_sampled(self, session_id: str, at: int, records: TokenRecords, epoch: int,
                       cell: str | None = None) -> None:
        """Append sampled tokens (loss mask 1) at buffer index `at` == the current length,
        accepted under ownership `epoch`, sampled by `cell`. The caller checked `at` (a
        mismatch is a Conflict, never a half-written buffer)."""
        row = self.require(session_id)
        if at != row.length:
            raise Conflict(f"sampled tokens at {at} but session {session_id} has {row.length}", code="misaligned")
        if records:
            self.buf.insert(sampled_chunks(row.id, at, records.token_ids, records.logprobs, records.versions,
                                           records.truncated, epoch, cell))
            self._set_length(row, len(records))

    def lengths(self, session_ids: Sequence[str]) -> dict[str, int]:
        """session → tokens in its buffer, for those of `session_ids` that exist (one read)."""
        ids, out = list(dict.fromkeys(session_ids)), {}
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            out.update(self.s.execute(f"SELECT id, length FROM sessions WHERE id IN ({','.join('?' * len(part))})",
                                      part).fetchall())
        return out

    def append_sampled_many(self, appends: Sequence[tuple[str, int, TokenRecords, int, str | None]],
                            lengths: dict[str, int] | None = None) -> None:
        """`append_sampled` for many (session, at, records, epoch, cell) at once: one statement
        for every chunk and one for the sessions' lengths (a sync's batches). Each `at`
        must be its session's length, counting the appends before it in `appends`; a mismatch
        is a Conflict and nothing of the call is written. `lengths`: the sessions' lengths
        before these appends as the caller read them in this transaction (not read again)."""
        sessions = [sid for sid, *_ in appends]
        have = dict(lengths) if lengths is not None else self.lengths(sessions)
        rows: list[tuple] = []
        for sid, at, rec, epoch, cell in appends:
            if sid not in have:
                raise NotFound(f"unknown session {sid!r}")
            if at != have[sid]:
                raise Conflict(f"sampled tokens at {at} but session {sid} has {have[sid]}", code="misaligned")
            if rec:
                ids, lps, vs, tr = rec.columns
                rows += sampled_rows(sid, at, ids, lps, vs, tr, epoch, cell)
            have[sid] = at + len(rec)
        self.buf.insert_rows(rows)
        update_by_key(self.s, "sessions", "id", ("length",), [(sid, have[sid]) for sid in dict.fromkeys(sessions)])

    def truncate(self, session_id: str, at: int) -> int:
        """Remove the tokens from buffer index `at` on (sampled tokens no client was shown,
        taken back to be sampled again); `at` must lie in the current segment. Returns how
        many were removed."""
        row = self.require(session_id)
        if not row.segment_starts[-1] <= at <= row.length:
            raise ValueError(f"truncate {session_id} at {at}: outside its current segment "
                             f"[{row.segment_starts[-1]}, {row.length}]")
        n = self.buf.truncate(session_id, at)
        self.s.execute("DELETE FROM session_context WHERE session_id=?", (session_id,))  # store/context.py
        row.length = at
        self.s.execute("UPDATE sessions SET length=? WHERE id=?", (at, session_id))
        return n

    def sampled_by(self, cell_id: str) -> list[tuple[str, int]]:
        """(session, first index) of every session holding tokens `cell_id` sampled."""
        return self.buf.samplers_from(cell_id)

    def samplers(self, session_id: str, start: int, end: int) -> list[str | None]:
        """The cell that sampled each token of [start, end) (None: a prompt token, or unknown)."""
        return [c for _, c in self.buf.per_token(session_id, start, end, "cell")]

    def mark_missing_from(self, session_id: str, start: int) -> int:
        """Unscored sampled tokens from `start` on will never be scored (their sampler was
        quarantined): provenance `missing`, so their versions can retire."""
        return self.buf.rescore(session_id, start, None, None, "missing", only_unscored=True)

    def taint(self, session_id: str) -> None:
        """The session holds tokens nobody can vouch for: it is never handed out for training."""
        self.s.execute("UPDATE sessions SET tainted=1 WHERE id=?", (session_id,))

    def tainted(self, session_id: str) -> bool:
        r = self.s.execute("SELECT tainted FROM sessions WHERE id=?", (session_id,)).fetchone()
        return bool(r and r[0])

    def epochs(self, session_id: str, start: int = 0) -> list[tuple[int, int | None]]:
        """(index, epoch) of the sampled tokens from `start`: the epochs they were accepted under."""
        return [(i, e) for c in self.buf.chunks(session_id, start) if c.loss_mask
                for i, e in zip(range(max(start, c.start), c.end), repeat(c.epoch))]

    def fill_old_logprobs(self, session_id: str, start: int, values: list[float | None], provenance: str,
                          version: int | None = None) -> int:
        """Set old log-probs of sampled tokens [start, start+len) — only those sampled under
        `version` when given (a range may span an update); returns rows changed."""
        return self.buf.rescore(session_id, start, start + len(values), values, provenance, version)

    def mark_missing(self, session_id: str, version: int, start: int, end: int) -> int:
        """Exact scoring of these tokens became impossible: provenance `missing` (counted)."""
        return self.buf.rescore(session_id, start, end, None, "missing", version, only_unscored=True)

    def unscored_ranges(self, limit: int = 256) -> list[UnscoredRange]:
        """Per (request, version) with unscored sampled tokens, oldest requests first. The
        chunks holding unscored tokens lead the join (scheduler/store/tokenbuf.py): the cost
        follows the scoring backlog in chunks, not the requests table (1,000,000 rows at scale)."""
        return [UnscoredRange._make(r) for r in self.buf.unscored_ranges(limit)]

    # -- trajectories
    def finish(self, session_id: str, reward: float, group_id: str | None) -> SessionRow:
        with self.s.tx(durable=True):
            row = self.require(session_id)
            if row.state == "finished":
                if (row.reward, row.group_id) == (reward, group_id):
                    return row  # an idempotent replay of the same finish
                raise Conflict(f"session {session_id!r} already finished", code="session_finished")
            (top,) = self.s.execute("SELECT COALESCE(MAX(finish_seq), 0) FROM sessions").fetchone()
            row.state, row.reward, row.group_id = "finished", reward, group_id
            row.finish_seq, row.finished_at = top + 1, time.time()
            self.put(row)
        return row

    def to_api(self, session_id: str, agent: str | None = None) -> dict[str, Any]:
        row = self.require(session_id, agent)
        t = self.read(session_id)
        return {
            "id": row.id, "state": row.state, "reward": row.reward, "group_id": row.group_id,
            "segment_starts": row.segment_starts,
            "token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask),
            "logprobs": list(t.logprobs), "versions": list(t.versions),
            "old_logprobs": list(t.old_logprobs), "provenance": list(t.provenance),
        }

    def trajectories(self, cursor: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """Finished sessions with finish_seq > cursor, oldest first; returns (items, next cursor)."""
        q = "SELECT id, finish_seq FROM sessions WHERE finish_seq > ? ORDER BY finish_seq LIMIT ?"
        rows = self.s.execute(q, (cursor, limit)).fetchall()
        items = [self.to_api(sid) for sid, _ in rows]
        return items, (rows[-1][1] if rows else cursor)

    def finished_after(self, cursor: int) -> int:
        """Finished sessions past `cursor` (trajectories not yet fetched)."""
        return self.s.execute("SELECT COUNT(*) FROM sessions WHERE finish_seq > ?", (cursor,)).fetchone()[0]

    # -- old log-prob accounting per version
    def version_counts(self) -> dict[int, dict[str, int]]:
        """Per behavior version: sampled tokens, exact, missing and unscored counts."""
        return self.buf.version_counts()

    def unscored_by_version(self) -> dict[int, int]:
        """Sampled tokens still without an old log-prob, per version (a small partial index)."""
        return self.buf.unscored_by_version()

    def unscored(self, version: int) -> int:
        return self.buf.unscored(version)

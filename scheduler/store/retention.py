"""Store tables of a trajectory's life after it finished: what training did with it (the
trainer's write-back), how far exporters have acknowledged, and bounded retention (which
trained trajectories are deleted, each deletion logged and counted).

Deletion takes a session's tokens, requests, migrations, gateway state, recorded messages and
outcome, and its
session row, but never the row holding the newest `finish_seq` (finish numbers are never
reused: an exporter's cursor stays valid). A session is eligible only once the trainer wrote
back an outcome for it, and with `require_exported` only at or below the exporters' ack.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from scheduler.contract.config.store import RetainConfig
from scheduler.contract.trajexport import TOKEN_ROW_BYTES
from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectory_outcomes(
  session_id TEXT PRIMARY KEY, outcome TEXT NOT NULL, at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS export_acks(
  name TEXT PRIMARY KEY, cursor INTEGER NOT NULL, at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS retention_log(
  at REAL NOT NULL, reason TEXT NOT NULL, sessions INTEGER NOT NULL, tokens INTEGER NOT NULL,
  first_seq INTEGER, last_seq INTEGER);
"""

_DELETES = (
    "DELETE FROM migrations WHERE request_id IN (SELECT id FROM requests WHERE session_id=?)",
    "DELETE FROM foreign_batches WHERE request_id IN (SELECT id FROM requests WHERE session_id=?)",
    "DELETE FROM requests WHERE session_id=?",
    "DELETE FROM token_chunks WHERE session_id=?",
    "DELETE FROM gateway_state WHERE session_id=?",
    "DELETE FROM session_context WHERE session_id=?",
    "DELETE FROM session_messages WHERE session_id=?",
    "DELETE FROM trajectory_outcomes WHERE session_id=?",
    "DELETE FROM sessions WHERE id=?",
)


class RetentionStore:
    def __init__(self, store: Database) -> None:
        self.s = store

    # -- the trainer's write-back
    def put_outcomes(self, outcomes: dict[str, dict[str, Any]]) -> int:
        """Record what training did with each session (a later record replaces an earlier
        one); unknown sessions are skipped. Returns how many were recorded."""
        now = time.time()
        with self.s.tx(durable=False):
            known = {sid for (sid,) in self.s.execute(
                f"SELECT id FROM sessions WHERE id IN ({','.join('?' * len(outcomes))})", list(outcomes))}
            self.s.executemany("INSERT OR REPLACE INTO trajectory_outcomes(session_id, outcome, at) VALUES (?,?,?)",
                               [(sid, dumps(o), now) for sid, o in outcomes.items() if sid in known])
        return len(known)

    def outcome(self, session_id: str) -> dict[str, Any] | None:
        r = self.s.execute("SELECT outcome FROM trajectory_outcomes WHERE session_id=?", (session_id,)).fetchone()
        return None if r is None else loads(r[0])

    # -- exporters' acknowledgements
    def ack(self, name: str, cursor: int) -> int:
        """An exporter holds every session up to `cursor` on disk; returns its ack (never lowered)."""
        with self.s.tx(durable=False):
            self.s.execute("INSERT INTO export_acks(name, cursor, at) VALUES (?,?,?) ON CONFLICT(name) DO UPDATE "
                           "SET cursor=MAX(cursor, excluded.cursor), at=excluded.at", (name, cursor, time.time()))
        return self.s.execute("SELECT cursor FROM export_acks WHERE name=?", (name,)).fetchone()[0]

    def acks(self) -> dict[str, int]:
        return dict(self.s.execute("SELECT name, cursor FROM export_acks ORDER BY name").fetchall())

    # -- bounded retention
    def deleted(self) -> dict[str, dict[str, int]]:
        """Per reason: sessions and tokens deleted so far (the store's own count)."""
        q = "SELECT reason, SUM(sessions), SUM(tokens) FROM retention_log GROUP BY reason"
        return {r: {"sessions": int(s), "tokens": int(t)} for r, s, t in self.s.execute(q)}

    def candidates(self, cfg: RetainConfig, now: float | None = None) -> list[tuple[str, int, int, str]]:
        """(session, finish_seq, tokens, reason) of the trajectories past `cfg`'s limits, oldest
        first, at most `cfg.max_per_pass`."""
        now = time.time() if now is None else now
        top = self.s.execute("SELECT COALESCE(MAX(finish_seq), 0) FROM sessions").fetchone()[0]
        cap = top - 1
        if cfg.require_exported:
            acked = self.s.execute("SELECT MIN(cursor) FROM export_acks").fetchone()[0]
            cap = min(cap, acked or 0)
        n, total = self.s.execute("SELECT COUNT(*), COALESCE(SUM(length), 0) FROM sessions WHERE finish_seq IS NOT NULL"
                                  ).fetchone()
        over_count = max(0, n - cfg.count) if cfg.count is not None else 0
        over_bytes = max(0, total * TOKEN_ROW_BYTES - cfg.bytes) if cfg.bytes is not None else 0
        q = ("SELECT s.id, s.finish_seq, s.length, s.finished_at FROM sessions s JOIN trajectory_outcomes o"
             " ON o.session_id = s.id WHERE s.finish_seq <= ? ORDER BY s.finish_seq LIMIT ?")
        out = []
        for sid, seq, length, finished in self.s.execute(q, (cap, cfg.max_per_pass)):
            if over_count > 0:
                reason, over_count = "count", over_count - 1
            elif over_bytes > 0:
                reason, over_bytes = "bytes", over_bytes - length * TOKEN_ROW_BYTES
            elif cfg.age_s is not None and finished is not None and now - finished > cfg.age_s:
                reason = "age"
            else:
                break
            out.append((sid, seq, length, reason))
        return out

    def purge(self, cfg: RetainConfig, now: float | None = None) -> dict[str, dict[str, int]]:
        """Delete the trajectories past `cfg`'s limits (one bounded pass) and log them; returns
        per reason the sessions and tokens deleted by this pass."""
        doomed = self.candidates(cfg, now)
        if not doomed:
            return {}
        out: dict[str, dict[str, int]] = {}
        with self.s.tx(durable=False):
            for sid, _, _, _ in doomed:
                for q in _DELETES:
                    self.s.execute(q, (sid,))
            for reason in sorted({d[3] for d in doomed}):
                mine = [d for d in doomed if d[3] == reason]
                out[reason] = {"sessions": len(mine), "tokens": sum(d[2] for d in mine)}
                self.s.execute("INSERT INTO retention_log(at, reason, sessions, tokens, first_seq, last_seq)"
                               " VALUES (?,?,?,?,?,?)", (time.time(), reason, len(mine), out[reason]["tokens"],
                                                         mine[0][1], mine[-1][1]))
        return out

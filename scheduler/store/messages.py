"""Store table of the OpenAI-format messages the gateway was sent, per turn, bounded per session
(docs/EXPORT.md `messages`).

Each turn's row holds what is new against the turn before: the first `keep` messages of the
turn before, then `messages` (a harness that resends the whole conversation costs only its new
messages). Once a session's recorded bytes would pass the cap
(`scheduler.store.messages_bytes`), its turns are kept as markers (request id and the bytes
they would have taken, no text): a truncated recording says so, never silently. Deleted with the
trajectory (scheduler/store/retention.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS session_messages(
  session_id TEXT NOT NULL, turn INTEGER NOT NULL, request_id TEXT NOT NULL, keep INTEGER,
  messages TEXT, hashes TEXT NOT NULL, bytes INTEGER NOT NULL, PRIMARY KEY(session_id, turn)) WITHOUT ROWID;
"""


def _digest(message: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(message, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


class MessageStore:
    def __init__(self, store: Database) -> None:
        self.s = store

    def record(self, session_id: str, request_id: str, messages: list[dict[str, Any]], cap: int) -> bool:
        """Record the turn of `request_id` as sent; returns False when the session's cap made it a
        marker (or `cap` is 0: nothing is recorded)."""
        if cap <= 0:
            return False
        last = self.s.execute("SELECT turn, hashes FROM session_messages WHERE session_id=? ORDER BY turn DESC"
                              " LIMIT 1", (session_id,)).fetchone()
        used = self.s.execute("SELECT COALESCE(SUM(bytes), 0), COUNT(messages) = COUNT(*) FROM session_messages"
                              " WHERE session_id=?", (session_id,)).fetchone()
        hashes = [_digest(m) for m in messages]
        keep = 0
        if last is not None:
            for a, b in zip(loads(last[1]), hashes):
                if a != b:
                    break
                keep += 1
        text = dumps(messages[keep:])
        size = len(text.encode())
        whole = bool(used[1]) and used[0] + size <= cap
        with self.s.tx(durable=False):
            self.s.execute("INSERT OR REPLACE INTO session_messages VALUES (?,?,?,?,?,?,?)",
                           (session_id, 0 if last is None else last[0] + 1, request_id, keep if whole else None,
                            text if whole else None, dumps(hashes), size))
        return whole

    def read(self, session_id: str) -> dict[str, Any] | None:
        """The session's recording as the export's `messages` column holds it (None: none)."""
        rows = self.s.execute("SELECT request_id, keep, messages, bytes FROM session_messages WHERE session_id=?"
                              " ORDER BY turn", (session_id,)).fetchall()
        if not rows:
            return None
        turns = [{"request_id": rid, "keep": keep, "messages": None if text is None else loads(text)}
                 for rid, keep, text, _ in rows]
        dropped = sum(1 for _, _, text, _ in rows if text is None)
        return {"turns": turns, "truncated": dropped > 0, "dropped_turns": dropped,
                "bytes": sum(b for _, _, _, b in rows)}


"""Each session's current segment as a length and a running hash (scheduler/contract/prefixhash.py).

A turn compares the client's prompt with the session's buffer, and a sticky turn tells its
cell which prefix it should already hold, by these two numbers: neither reads the context
back. One row per session (`session_context`, beside `sessions`: the token table's layout
is not this module's concern): the segment it hashes, and the hash's state over
[seg_start, seg_start + n). The hash is caught up when asked for (`segment_hash`), reading only
the tokens appended since it was last kept — a turn's new prompt and the previous turn's
sampled tokens —, and recomputed from the segment's start when the segment changed or the
buffer was cut below it (`forget`, called where the buffer is truncated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.contract.prefixhash import PrefixHash
from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS session_context(
  session_id TEXT PRIMARY KEY, seg_start INTEGER NOT NULL, state TEXT NOT NULL) WITHOUT ROWID;
"""

TokenReader = Callable[[str, int, int], list[int]]
"""(session, start, end) → the buffer's token ids [start, end)."""


class ContextStore:
    def __init__(self, store: Database, read: TokenReader) -> None:
        self.s = store
        self.read = read
        self.tokens_read = 0
        """Token ids read to catch hashes up (a bench and the tests watch it stay O(new))."""

    def segment_hash(self, session_id: str, seg_start: int, length: int) -> PrefixHash:
        """The running hash of the buffer's [seg_start, length), kept for the next call."""
        r = self.s.execute("SELECT seg_start, state FROM session_context WHERE session_id=?",
                           (session_id,)).fetchone()
        h = None
        if r is not None and r[0] == seg_start:
            h = PrefixHash.from_json(loads(r[1]))
            if seg_start + h.length > length:
                h = None  # the buffer was cut below what was hashed (forget was not told)
        if h is None:
            h = PrefixHash()
        if seg_start + h.length < length:
            new = self.read(session_id, seg_start + h.length, length)
            self.tokens_read += len(new)
            h.extend(new)
            with self.s.tx(durable=False):  # a cache of the buffer: rebuilt from it if lost
                self.s.execute("INSERT OR REPLACE INTO session_context(session_id, seg_start, state) VALUES (?, ?, ?)",
                               (session_id, seg_start, dumps(h.to_json())))
        return h

    def forget(self, session_id: str) -> None:
        """The buffer was cut (or the session removed): the next hash starts over."""
        self.s.execute("DELETE FROM session_context WHERE session_id=?", (session_id,))

    def previous_request(self, session_id: str, request_id: str) -> tuple[str | None, str, int, int, int] | None:
        """(cell, state, prompt_start, end, by_kv) of the session's latest request before
        `request_id` (end: its base plus generated tokens; by_kv: 1 when that cell got it by a
        KV copy, with no start of its own); None for the first."""
        q = ("SELECT r.cell_id, r.state, r.prompt_start, r.base + r.num_generated, EXISTS(SELECT 1 FROM migrations m"
             " WHERE m.state='committed' AND m.request_id=r.id AND m.path='kv' AND m.dst=r.cell_id)"
             " FROM requests r WHERE r.session_id=? AND r.id<>? ORDER BY r.created_at DESC LIMIT 1")
        return self.s.execute(q, (session_id, request_id)).fetchone()

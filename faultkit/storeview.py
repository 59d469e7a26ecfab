"""The scheduler's store read-only (SQLite, `mode=ro`): the snapshots the checkers read."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from scheduler.store.tokenpack import COLS, Chunk


# -- the store, read-only --------------------------------------------------------------------
def read_store(conn: sqlite3.Connection, sessions: list[str] | None = None, full: bool = False) -> dict:
    """One consistent snapshot (checker.py's `sample` shape); `sessions`: also their token
    rows [(idx, token_id, loss_mask, version, provenance)]; `full`: with cell histories."""
    conn.execute("BEGIN")
    try:
        s: dict[str, Any] = {}
        s["requests"] = {r[0]: {"cell": r[1], "epoch": r[2], "state": r[3], "n": r[4], "session": r[5],
                                "base": r[6], "reason": r[7]}
                         for r in conn.execute("SELECT id, cell_id, epoch, state, num_generated, session_id, base,"
                                               " reason FROM requests")}
        s["migrations"] = {r[0]: {"request": r[1], "src": r[2], "dst": r[3], "epoch": r[4], "state": r[5],
                                  "path": r[6], "finished_at": r[7], "created_at": r[8], "commit_tokens": r[9]}
                           for r in conn.execute("SELECT id, request_id, src, dst, epoch, state, path, finished_at,"
                                                 " created_at, commit_tokens FROM migrations")}
        s["cells"] = {r[0]: {"state": r[1], "generation": r[2], "incarnation": r[3], "version": r[4],
                             "history": json.loads(r[5]) if full else []}
                      for r in conn.execute("SELECT id, state, generation, incarnation, version, history FROM cells")}
        s["versions"] = dict(conn.execute("SELECT v, state FROM versions").fetchall())
        s["unscored"] = dict(conn.execute("SELECT version, SUM(unscored) FROM token_chunks WHERE unscored > 0"
                                          " GROUP BY version").fetchall())
        s["flips"] = {r[0]: r[1] for r in conn.execute("SELECT id, state FROM flips")}
        s["foreign_batches"] = [{"request": r[0], "cell": r[1], "epoch": r[2], "owner": r[3], "owner_epoch": r[4],
                                 "start": r[5], "count": r[6], "new": r[7]}
                                for r in conn.execute("SELECT request_id, cell_id, epoch, owner, owner_epoch, start,"
                                                      " count, new FROM foreign_batches ORDER BY at")]
        if full:
            s["flip_rows"] = {r[0]: {"cell": r[1], "to": r[2], "state": r[3], "created_at": r[4]}
                              for r in conn.execute("SELECT id, cell_id, to_role, state, created_at FROM flips")}
        if sessions:
            chunks = {sid: [Chunk.from_row(r) for r in conn.execute(
                f"SELECT {COLS} FROM token_chunks WHERE session_id = ? ORDER BY start", (sid,))] for sid in sessions}
            s["tokens"] = {sid: _token_rows(cs) for sid, cs in chunks.items()}
            s["token_epochs"] = {sid: [(i, c.epoch) for c in cs if c.loss_mask for i in range(c.start, c.end)]
                                 for sid, cs in chunks.items()}
    finally:
        conn.execute("COMMIT")
    return s


def _token_rows(chunks: list[Chunk]) -> list[tuple]:
    """(idx, token_id, loss_mask, version, provenance) of each token of the chunks."""
    out: list[tuple] = []
    for c in chunks:
        ids, mask, _, ver, _, _, prov = c.columns(c.start, c.end)
        out += zip(range(c.start, c.end), ids, mask, ver, prov)
    return out


def open_store(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, isolation_level=None,
                           check_same_thread=False)

"""The scheduler's store read-only (SQLite, `mode=ro`): the snapshots the checkers read."""

from __future__ import annotations

import json
import sqlite3
from typing import Any


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
        s["unscored"] = dict(conn.execute("SELECT version, COUNT(*) FROM tokens WHERE loss_mask = 1 AND provenance"
                                          " IS NULL GROUP BY version").fetchall())
        s["flips"] = {r[0]: r[1] for r in conn.execute("SELECT id, state FROM flips")}
        s["foreign_batches"] = [{"request": r[0], "cell": r[1], "epoch": r[2], "owner": r[3], "owner_epoch": r[4],
                                 "start": r[5], "count": r[6], "new": r[7]}
                                for r in conn.execute("SELECT request_id, cell_id, epoch, owner, owner_epoch, start,"
                                                      " count, new FROM foreign_batches ORDER BY at")]
        if full:
            s["flip_rows"] = {r[0]: {"cell": r[1], "to": r[2], "state": r[3], "created_at": r[4]}
                              for r in conn.execute("SELECT id, cell_id, to_role, state, created_at FROM flips")}
        if sessions:
            s["tokens"] = {sid: conn.execute("SELECT idx, token_id, loss_mask, version, provenance FROM tokens"
                                             " WHERE session_id = ? ORDER BY idx", (sid,)).fetchall()
                           for sid in sessions}
            s["token_epochs"] = {sid: conn.execute("SELECT idx, epoch FROM tokens WHERE session_id = ? AND"
                                                   " loss_mask = 1 ORDER BY idx", (sid,)).fetchall()
                                 for sid in sessions}
    finally:
        conn.execute("COMMIT")
    return s


def open_store(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, isolation_level=None,
                           check_same_thread=False)

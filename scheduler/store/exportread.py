"""The export's read of finished trajectories: side-effect free (no cursor, no counter, no
write), one page at a time, bounded in sessions and tokens so that a page's cost to the event
loop is bounded (scheduler/contract/trajexport.py `MAX_PAGE_*`).

A page holds the finished sessions with `finish_seq` past a cursor, oldest first, each as one
row of columns (docs/EXPORT.md): the session, its tokens column by column, its turns (the
requests that sampled it), its migrations, and what training did with it (the outcome the
trainer wrote back: scheduler/store/retention.py). The per-token sampler is given as an index
into the row's `cells`. Reads only; the tables are the other modules'.
"""

from __future__ import annotations

import base64
import sys
from array import array
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from scheduler.contract.trajexport import PROVENANCE_CODES, branch_of, job_of
from scheduler.store.codec import loads
from scheduler.store.tokenbuf import TokenBuffer
from scheduler.store.tokenpack import Chunk

if TYPE_CHECKING:
    from scheduler.store.base import Database

_REQUESTS = ("SELECT id, prompt_start, base, num_generated, cell_id, epoch, state, reason, params, created_at,"
             " updated_at FROM requests WHERE session_id=? ORDER BY base, created_at")
_MIGRATIONS = ("SELECT m.request_id, m.src, m.dst, m.path, m.epoch, m.state, m.reason, m.created_at, m.finished_at,"
               " m.commit_tokens, m.stall_s FROM migrations m JOIN requests r ON m.request_id = r.id WHERE r.session_id=?"
               " ORDER BY m.created_at, m.id")
_REQ_KEYS = ("request_id", "prompt_start", "base", "num_generated", "cell", "epoch", "state", "reason", "params",
             "created_at", "updated_at")
_MIG_KEYS = ("request_id", "src", "dst", "path", "epoch", "state", "reason", "created_at", "finished_at",
             "commit_tokens", "stall_s")


PACKED = {"token_ids": "i", "loss_mask": "b", "logprob": "f", "version": "i", "old_logprob": "f",
          "old_provenance": "b", "cell_idx": "h", "truncated": "b"}
"""The per-token columns' types when packed (`array` typecodes, little-endian on the wire:
int32, int8, float32, int32, float32, int8, int16, int8); a null is NaN in a float column and
-1 in `version`."""
_NAN = float("nan")


def pack(cols: dict[str, Any]) -> dict[str, Any]:
    """The row's per-token columns as base64 of little-endian arrays (`packed`), with the count
    of log-probs float32 does not hold exactly (`f32_inexact`)."""
    out, inexact = {}, 0
    for key, code in PACKED.items():
        vals = cols.pop(key)
        if code == "f":
            vals = [_NAN if x is None else x for x in vals]
            a = array("f", vals)
            if array("d", a) != array("d", vals):
                inexact += sum(1 for x, y in zip(a, vals) if x != y and x == x)
        else:
            a = array(code, [-1 if x is None else x for x in vals] if key == "version" else vals)
        if sys.byteorder != "little":
            a.byteswap()
        out[key] = base64.b64encode(a.tobytes()).decode()
    cols["packed"], cols["f32_inexact"] = out, inexact
    return cols


def _token_columns(chunks: list[Chunk]) -> dict[str, Any]:
    """A session's chunks (scheduler/store/tokenpack.py) as the row's per-token columns."""
    cells = sorted({c.cell for c in chunks if c.cell is not None})
    index = {c: i for i, c in enumerate(cells)}
    cols = [c.columns(c.start, c.end) for c in chunks]
    ids, mask, lp, ver, trunc, old, prov = (list(chain.from_iterable(k)) for k in zip(*cols)) if cols else (
        [] for _ in range(7))
    codes = PROVENANCE_CODES
    return {"token_ids": ids, "loss_mask": mask, "logprob": lp, "version": ver, "old_logprob": old,
            "old_provenance": [codes.get(p, 0) for p in prov],
            "cell_idx": list(chain.from_iterable(repeat(index.get(c.cell, -1), c.n) for c in chunks)),
            "truncated": trunc, "cells": cells}


class ExportReader:
    def __init__(self, store: Database) -> None:
        self.s = store
        self.buf = TokenBuffer(store)

    def page(self, after: int, limit: int, max_tokens: int, job: str | None = None, packed: bool = False
             ) -> tuple[list[dict[str, Any]], int]:
        """Finished sessions with finish_seq > `after`, oldest first: at most `limit`, and no
        more once `max_tokens` tokens are in (always at least one). Returns (rows, the cursor
        after the last row read); a `job` filter skips the others' sessions (the cursor still
        moves past them). `packed`: per-token columns as `pack` gives them."""
        q = ("SELECT id, finish_seq, length, reward, group_id, created_at, finished_at, segment_starts, tainted"
             " FROM sessions WHERE finish_seq > ? ORDER BY finish_seq LIMIT ?")
        out: list[dict[str, Any]] = []
        cursor, tokens = after, 0
        for sid, seq, length, reward, group, created, finished, segs, tainted in self.s.execute(q, (after, limit)):
            if out and tokens + length > max_tokens:
                break
            cursor = seq
            if job is not None and job_of(sid) != job:
                continue
            tokens += length
            row = self._row(sid, seq, reward, group, created, finished, loads(segs), tainted)
            out.append(pack(row) if packed else row)
        return out, cursor

    def _row(self, sid: str, seq: int, reward: float | None, group: str | None, created: float,
             finished: float | None, segment_starts: list[int], tainted: int) -> dict[str, Any]:
        parent, branch = branch_of(sid)
        row: dict[str, Any] = {
            "session_id": sid, "finish_seq": seq, "job": job_of(sid), "group_id": group,
            "parent_id": parent, "branch": branch, "reward": reward, "finish_reason": None,
            "created_at": created, "finished_at": finished, "segment_starts": segment_starts,
            "tainted": bool(tainted),
        }
        row.update(_token_columns(self.buf.chunks(sid)))
        turns = [dict(zip(_REQ_KEYS, r, strict=True)) for r in self.s.execute(_REQUESTS, (sid,))]
        for t in turns:
            t["params"] = loads(t["params"])
        row["turns"] = turns
        row["finish_reason"] = _finish_reason(turns)
        row["migrations"] = [dict(zip(_MIG_KEYS, r, strict=True)) for r in self.s.execute(_MIGRATIONS, (sid,))]
        row["messages"] = self.s.messages.read(sid)  # as the gateway was sent them (store/messages.py)
        row["training"] = self.s.retention.outcome(sid)
        return row

    def latest(self) -> int:
        """The newest finish_seq (0 before any session finished)."""
        return self.s.execute("SELECT COALESCE(MAX(finish_seq), 0) FROM sessions").fetchone()[0]


def _finish_reason(turns: list[dict[str, Any]]) -> str | None:
    """The last turn's end: its request's reason (`stop`, `length`, ...) else its state."""
    if not turns:
        return None
    last = turns[-1]
    return last["reason"] or last["state"]

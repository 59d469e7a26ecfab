"""Finished sessions copied in bulk from template rows (the export's own rows of a real run),
for benches that need a store of many sessions: each copy gets a fresh id and finish number,
its template's tokens, log-probs, versions, samplers and turns. Writes only through this
store's tables, in one transaction per `batch` sessions."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from scheduler.store.codec import dumps
from scheduler.store.tokenbuf import TokenBuffer, legacy_chunks

if TYPE_CHECKING:
    from scheduler.store.base import Database

_PROV = {0: None, 1: "exact", 2: "missing"}


def _tokens(sid: str, row: dict[str, Any]) -> list[tuple]:
    """The template's tokens as per-token rows (`tokenbuf.legacy_chunks` packs them)."""
    cells = row["cells"]
    return [(sid, i, t, m, lp, v, tr, old, _PROV[p], 0, cells[c] if c >= 0 else None)
            for i, (t, m, lp, v, tr, old, p, c) in enumerate(zip(
                row["token_ids"], row["loss_mask"], row["logprob"], row["version"], row["truncated"],
                row["old_logprob"], row["old_provenance"], row["cell_idx"], strict=True))]


def replicate(store: Database, templates: list[dict[str, Any]], n: int, prefix: str = "bench",
              batch: int = 500) -> int:
    """Add `n` finished sessions cycling through `templates`; returns the tokens written."""
    (top,) = store.execute("SELECT COALESCE(MAX(finish_seq), 0) FROM sessions").fetchone()
    written, now, buf = 0, time.time(), TokenBuffer(store)
    for lo in range(0, n, batch):
        with store.tx(durable=False):
            for k in range(lo, min(n, lo + batch)):
                row = templates[k % len(templates)]
                sid = f"{prefix}-e{k}"
                top += 1
                store.execute("INSERT INTO sessions(id, state, length, segment_starts, reward, group_id, finish_seq,"
                              " created_at, finished_at) VALUES (?,?,?,?,?,?,?,?,?)",
                              (sid, "finished", len(row["token_ids"]), dumps(row["segment_starts"]), row["reward"],
                               f"{prefix}-g{k // 8}", top, now, now))
                buf.insert(list(legacy_chunks(_tokens(sid, row))))
                for j, t in enumerate(row["turns"]):
                    params = t["params"] if isinstance(t["params"], str) else json.dumps(t["params"])
                    store.execute("INSERT INTO requests(id, session_id, base, prompt_start, num_generated, params,"
                                  " cell_id, epoch, state, reason, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,"
                                  "?,?,?)", (f"{sid}-r{j}", sid, t["base"], t["prompt_start"], t["num_generated"],
                                             params, None, t["epoch"], "finished", t["reason"], now, now))
                written += len(row["token_ids"])
    return written

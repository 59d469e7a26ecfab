"""Ownership as the cells saw it: each cell's log of the token batches the scheduler accepted
from it (`cells/agent/owned.py`, `CELLFLIP_SYNC_LOG`). Independent of the store's bookkeeping
(its rows, epochs, history): the evidence is what each cell was told.

Why the order of sends decides: a batch at epoch e is accepted before the request is fenced
to epoch e' > e, and a batch at e' can only be made after the new owner learned of e', i.e.
after the fence. So in a fenced system, every accepted batch at e was sent before every
accepted batch at e' > e; one sent later was accepted by a scheduler that did not fence."""

from __future__ import annotations

import json
from pathlib import Path

CELL_LOGS = "in the cells' own logs"
"""Marks the violations found in what the cells logged alone (their accepted syncs here, their
migration outcomes in `checker.check_migration_outcomes`): I2 from the cells' side."""


def read_sync_log(path: Path, offset: int = 0) -> list[dict]:
    """The records appended at or after byte `offset` (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def commit_fences(outcomes: list[dict]) -> list[dict]:
    """From the cells' migration logs: each committed destination's epoch and the wall-clock
    instant it learned of its commit (after the scheduler fenced the source's epoch)."""
    return [{"request": o["request_id"], "epoch": o["epoch"], "at": o["marks"]["committed"], "cell": o.get("cell")}
            for o in outcomes if o.get("role") == "destination" and o.get("result") == "committed"
            and o.get("epoch") is not None and "committed" in (o.get("marks") or {})]


def check_accepted_syncs(records: list[dict], fences: list[dict] = ()) -> list[str]:
    """I2 from the cells' logs: per request, no accepted batch sent after an accepted batch of a
    newer epoch or after a destination learned of its commit to a newer epoch (`fences`), and
    no two cells accepted at one epoch. One violation per request."""
    by_request: dict[str, list[dict]] = {}
    for r in records:
        by_request.setdefault(r["request"], []).append(r)
    for f in fences:  # a commit is an accepted hand-over at its epoch: it fences like a batch
        by_request.setdefault(f["request"], []).append(
            {"cell": f.get("cell") or "the destination", "epoch": f["epoch"], "start": None, "sent": f["at"],
             "fence": True})
    out = []
    for rid, recs in sorted(by_request.items()):
        if v := _first_split(rid, sorted(recs, key=lambda r: r["sent"])):
            out.append(v)
    return out


def _first_split(rid: str, recs: list[dict]) -> str | None:
    newest: dict | None = None
    owner_at: dict[int, str] = {}
    for r in recs:
        if not r.get("fence"):
            other = owner_at.setdefault(r["epoch"], r["cell"])
            if other != r["cell"]:
                return f"I2: {CELL_LOGS}, {rid} had tokens accepted from {other} and {r['cell']} at one epoch {r['epoch']}"
            if newest is not None and r["epoch"] < newest["epoch"]:
                what = "learned of its commit at" if newest.get("fence") else "had tokens accepted at"
                return (f"I2: {CELL_LOGS}, {rid}: {r['cell']}'s tokens at epoch {r['epoch']} (from index "
                        f"{r['start']}) were accepted though sent {r['sent'] - newest['sent']:.3f}s after "
                        f"{newest['cell']} {what} epoch {newest['epoch']}")
        if newest is None or r["epoch"] > newest["epoch"]:
            newest = r
    return None

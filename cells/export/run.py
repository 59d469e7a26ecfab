"""The export loop: stream → parts → manifest → ack.

    cursor = max(--since, the directory's cursor)
    loop: stream rows past cursor → every `part_rows` rows (or `part_tokens` tokens) write a part
          → ack the cursor (retention may then delete them when configured to wait for exports)
          → without --follow stop at the newest finished session; with it wait `poll_s` and go on
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cells.export import table
from cells.export.source import ExportError, ExportSource
from cells.export.writer import ExportDir


@dataclass
class ExportStats:
    rows: int = 0
    tokens: int = 0
    parts: list[str] = field(default_factory=list)
    cursor: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """This process's CPU seconds in the export loop (start-up and imports not counted)."""


class _Batch:
    def __init__(self, after: int) -> None:
        self.after, self.rows, self.tokens = after, [], 0


def export_once(src: ExportSource, out: ExportDir, stats: ExportStats, job: str | None, part_rows: int,
                part_tokens: int, ack: bool = True) -> int:
    """Export every finished session past the directory's cursor up to the newest one at the
    stream's start; returns the rows written."""
    before = stats.rows
    batch = _Batch(out.cursor)
    nxt = out.cursor
    for item in src.stream(out.cursor, job):
        if "next" in item and "session_id" not in item:
            nxt = int(item["next"])
            break
        batch.rows.append(item)
        batch.tokens += table.num_tokens(item)
        if len(batch.rows) >= part_rows or batch.tokens >= part_tokens:
            _flush(src, out, stats, batch, ack)
            batch = _Batch(out.cursor)
    _flush(src, out, stats, batch, ack)
    if nxt > out.cursor:
        out.advance(nxt)
        if ack:
            src.ack(out.manifest["exporter"], out.cursor)
    stats.cursor = out.cursor
    return stats.rows - before


def _flush(src: ExportSource, out: ExportDir, stats: ExportStats, batch: _Batch, ack: bool) -> None:
    if not batch.rows:
        return
    stats.parts.append(out.write_part(batch.after, batch.rows))
    stats.rows += len(batch.rows)
    stats.tokens += batch.tokens
    if ack:
        src.ack(out.manifest["exporter"], out.cursor)


def run_export(src: ExportSource, out: ExportDir, *, since: int = 0, job: str | None = None, follow: bool = False,
               part_rows: int = 4096, part_tokens: int = 8 << 20, poll_s: float = 2.0,
               stop: threading.Event | None = None, ack: bool = True) -> ExportStats:
    """Export to `out` (once, or with `follow` until `stop` is set)."""
    stop = stop or threading.Event()
    if since > out.cursor:
        out.advance(since)
    stats = ExportStats(cursor=out.cursor)
    t0, c0 = time.perf_counter(), time.process_time()
    while True:
        try:
            export_once(src, out, stats, job, part_rows, part_tokens, ack)
        except ExportError:
            if not follow:
                raise
        if not follow or stop.wait(poll_s):
            break
    stats.wall_s, stats.cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return stats


def summary(stats: ExportStats, out: ExportDir) -> dict[str, Any]:
    m = out.manifest
    return {"dir": str(out.dir), "format": m["format"], "rows_written": stats.rows, "tokens_written": stats.tokens,
            "parts_written": len(stats.parts), "cursor": out.cursor, "rows_total": m["rows"],
            "tokens_total": m["tokens"], "wall_s": round(stats.wall_s, 3),
            "cpu_s": round(stats.cpu_s, 3)}

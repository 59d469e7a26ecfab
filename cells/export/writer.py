"""The export directory: part files written whole (a temporary name, fsync, rename), and the
manifest (config, schema version, row and token counts, each part's SHA-256), rewritten the
same way after each part. Parts live in `DIR/data/` (a parquet dataset by themselves:
`pyarrow.parquet.read_table("DIR/data")`, `datasets.load_dataset("parquet", data_files="DIR/data/*.parquet")`).

Exactly once, across restarts: each part holds the rows with finish numbers in
(`after`, `last`] and its name says so (`part-<after+1>-<last>.<ext>`); a restarted exporter
resumes at the highest `last` of the complete parts on disk (and of the manifest's `cursor`,
which also counts sessions a `--job` filter skipped), so a row is never written twice and
never skipped. Leftover temporary files of an interrupted part are removed on open.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from cells.export import table
from scheduler.contract.trajexport import SCHEMA_VERSION

MANIFEST = "manifest.json"
PART_RE = re.compile(r"^part-(?P<first>[0-9]{12})-(?P<last>[0-9]{12})\.(?P<ext>jsonl|parquet)$")
FORMATS = ("parquet", "jsonl")


def _write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ExportDir:
    """One export directory: its manifest and its parts."""

    def __init__(self, out: str | Path, fmt: str, config: dict[str, Any]) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
        self.dir = Path(out)
        self.data = self.dir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        for tmp in self.data.glob(".*.tmp"):
            tmp.unlink()
        self.fmt = fmt
        path = self.dir / MANIFEST
        self.manifest: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {
            "schema_version": SCHEMA_VERSION, "format": fmt, "exporter": f"exp-{secrets.token_hex(4)}",
            "created_at": time.time(), "config": config, "parts": [], "rows": 0, "tokens": 0, "cursor": 0,
            "versions": [], "float32_inexact": 0}
        m = self.manifest
        if m["format"] != fmt:
            raise ValueError(f"{self.dir} holds a {m['format']} export; asked for {fmt}")
        if m["schema_version"] != SCHEMA_VERSION:
            raise ValueError(f"{self.dir} holds schema {m['schema_version']}; this exporter writes {SCHEMA_VERSION}")
        self._adopt_parts()

    def _adopt_parts(self) -> None:
        """Complete parts on disk the manifest does not list yet (written just before a crash)."""
        listed = {p["file"] for p in self.manifest["parts"]}
        for f in sorted(self.data.iterdir()):
            m = PART_RE.match(f.name)
            if m is None or f"data/{f.name}" in listed:
                continue
            data = f.read_bytes()
            rows = self._count_rows(f, data)
            self._list(f"data/{f.name}", int(m["first"]) - 1, int(m["last"]), rows, data)
        self._save()

    def _count_rows(self, f: Path, data: bytes) -> tuple[int, int]:
        if f.suffix == ".jsonl":
            rows = [json.loads(line) for line in data.splitlines() if line]
            return len(rows), sum(len(r["token_ids"]) for r in rows)
        import pyarrow.parquet as pq

        t = pq.read_table(f, columns=["token_ids"])
        return t.num_rows, sum(len(x) for x in t.column("token_ids").to_pylist())

    @property
    def cursor(self) -> int:
        return int(self.manifest["cursor"])

    def write_part(self, after: int, rows: list[dict[str, Any]]) -> str:
        """Write the rows (finish numbers in (`after`, last row's]) as one part; returns its name."""
        last = rows[-1]["finish_seq"]
        ext = "parquet" if self.fmt == "parquet" else "jsonl"
        name = f"part-{after + 1:012d}-{last:012d}.{ext}"
        if self.fmt == "parquet":
            data = table.parquet_bytes([table.flat_row(r, lists=False) for r in rows])
        else:
            data = table.jsonl_bytes([table.flat_row(r) for r in rows])
        self.manifest["float32_inexact"] += table.float32_inexact(rows)
        _write_whole(self.data / name, data)
        self._list(f"data/{name}", after, last, (len(rows), sum(table.num_tokens(r) for r in rows)), data,
                   versions=set().union(*(table.row_versions(r) for r in rows)))
        self._save()
        return f"data/{name}"

    def _list(self, name: str, after: int, last: int, counts: tuple[int, int], data: bytes,
              versions: set[int] | None = None) -> None:
        m = self.manifest
        m["parts"].append({"file": name, "first_seq": after + 1, "last_seq": last, "rows": counts[0],
                           "tokens": counts[1], "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        m["rows"] += counts[0]
        m["tokens"] += counts[1]
        m["cursor"] = max(m["cursor"], last)
        if versions:
            m["versions"] = sorted(set(m["versions"]) | versions)

    def advance(self, cursor: int) -> None:
        """Sessions up to `cursor` are settled with no row here (a `--job` filter skipped them)."""
        if cursor > self.cursor:
            self.manifest["cursor"] = cursor
            self._save()

    def note(self, key: str, value: Any) -> None:
        self.manifest[key] = value
        self._save()

    def _save(self) -> None:
        self.manifest["updated_at"] = time.time()
        _write_whole(self.dir / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    def part_paths(self) -> list[Path]:
        return [self.dir / p["file"] for p in self.manifest["parts"]]


def verify(out: str | Path) -> list[str]:
    """Problems with an export directory: a listed part missing or not matching its checksum."""
    d = Path(out)
    m = json.loads((d / MANIFEST).read_text())
    problems = []
    for p in m["parts"]:
        f = d / p["file"]
        if not f.is_file():
            problems.append(f"{p['file']}: missing")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != p["sha256"]:
            problems.append(f"{p['file']}: checksum differs from the manifest")
    return problems


def read_rows(out: str | Path) -> list[dict[str, Any]]:
    """Every row of an export directory as flat dicts, in finish order (either format)."""
    d = Path(out)
    m = json.loads((d / MANIFEST).read_text())
    rows: list[dict[str, Any]] = []
    for p in m["parts"]:
        f = d / p["file"]
        if f.suffix == ".jsonl":
            rows += [json.loads(line) for line in f.read_bytes().splitlines() if line]
        else:
            import pyarrow.parquet as pq

            rows += pq.read_table(f).to_pylist()
    return rows

"""The operation history of a fault campaign (Jepsen style), one JSON object per line.

Every record: `i` (its index), `type` (`invoke`, `ok`, `fail` or `info`), `process` (who did
it: `client-3`, `nemesis`, `sampler`, `campaign`), `f` (what: `request`, `fault`, `restart`,
`sample`, ...), `t` (monotonic seconds of this process), `value` (a JSON object) and, for `ok`
and `fail`, `ref` (the index of the `invoke` it completes). An `invoke` with no completion is
an operation whose outcome is unknown (a client that never heard back).

Thread-safe; records reach the file (if any) as they happen, so a campaign that dies leaves
its history behind.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

TYPES = ("invoke", "ok", "fail", "info")


class History:
    def __init__(self, path: str | Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.records: list[dict[str, Any]] = []
        self.clock = clock
        self._lock = threading.Lock()
        self._file = open(path, "a") if path is not None else None  # noqa: SIM115 (closed in close())

    def _add(self, type_: str, process: str, f: str, value: dict, ref: int | None = None,
             t: float | None = None) -> int:
        with self._lock:
            rec: dict[str, Any] = {"i": len(self.records), "type": type_, "process": process, "f": f,
                                   "t": self.clock() if t is None else t, "value": value}
            if ref is not None:
                rec["ref"] = ref
            self.records.append(rec)
            if self._file is not None:
                self._file.write(json.dumps(rec, default=str) + "\n")
                self._file.flush()
            return rec["i"]

    def invoke(self, process: str, f: str, **value: Any) -> int:
        """Start an operation; returns its index (for `ok` / `fail`)."""
        return self._add("invoke", process, f, value)

    def ok(self, ref: int, **value: Any) -> int:
        inv = self.records[ref]
        return self._add("ok", inv["process"], inv["f"], value, ref)

    def fail(self, ref: int, reason: str, **value: Any) -> int:
        inv = self.records[ref]
        return self._add("fail", inv["process"], inv["f"], {"reason": reason, **value}, ref)

    def info(self, process: str, f: str, t: float | None = None, **value: Any) -> int:
        """Something observed (a sample, a fault that fired, a process restart)."""
        return self._add("info", process, f, value, t=t)

    def select(self, f: str | None = None, type_: str | None = None, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            recs = self.records[since:]
        return [r for r in recs if (f is None or r["f"] == f) and (type_ is None or r["type"] == type_)]

    def completion(self, ref: int) -> dict[str, Any] | None:
        """The `ok` / `fail` record of invoke `ref`, or None while it is open."""
        with self._lock:
            for r in self.records[ref + 1:]:
                if r.get("ref") == ref:
                    return r
        return None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def load(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def pairs(records: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(invoke, its completion or None) for every invoke, in invoke order."""
    recs = list(records)
    done = {r["ref"]: r for r in recs if "ref" in r}
    return [(r, done.get(r["i"])) for r in recs if r["type"] == "invoke"]

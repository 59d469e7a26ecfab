"""Store checks shared by the edge tests: a refused request leaves the store as it was."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx

from tests.scheduler.sched_fakes import FakeCell, Harness


def store_dump(db_path: str | Path) -> dict[str, list]:
    """Every row of every table of the store (read through a second connection)."""
    conn = sqlite3.connect(str(db_path))
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {n: sorted(map(repr, conn.execute(f"SELECT * FROM {n}"))) for n in names}
    finally:
        conn.close()


def fleet(h: Harness, n: int) -> list[FakeCell]:
    cells = [FakeCell(h.client, f"c{i}") for i in range(n)]
    for c in cells:
        c.register()
        c.sync()
    return cells


def rejected(client, db, method: str, path: str, status: int, **kw) -> httpx.Response:
    """Send one request that must be refused with `status`, and leave the store unchanged."""
    before = store_dump(db)
    r = client.request(method, path, **kw)
    assert r.status_code == status, (method, path, r.status_code, r.text[:300])
    assert store_dump(db) == before, f"{method} {path} ({status}) changed the store"
    return r

"""Store tables of jobs: the RL jobs one fleet serves, which job each cell, session, weight
version and API token belongs to, and the durable record of a cell's move between jobs.

- `jobs`: name, model (a preset or a Hugging Face path), `min_cells`, `max_cells`, `weight`,
  settings (objective, staleness, admission: JSON) and state (`active` → `draining` →
  `deleted`). The implicit job `default` is there from the first open, so a fleet that never
  names a job serves exactly one, as before.
- `job_of`: (kind, key) → job for `cell`, `session`, `version` and `token`. A side table, not a
  column of those tables: their rows are written whole (`INSERT OR REPLACE`), which would put
  an added column back to its default at every write. No row means the job `default`.
- `job_moves`: a cell's move from one job to another (`draining` → `loading` → `done`, or
  `undone`), written before anything of the move happens, so a restarted scheduler finishes
  or undoes it (scheduler/control/jobs.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.store.codec import dumps, loads

if TYPE_CHECKING:
    from scheduler.store.base import Database

DEFAULT_JOB = "default"
"""The job every cell, session, version and token belongs to unless told otherwise."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs(
  name TEXT PRIMARY KEY, model TEXT NOT NULL, min_cells INTEGER NOT NULL, max_cells INTEGER,
  weight REAL NOT NULL, settings TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL,
  history TEXT NOT NULL);
INSERT OR IGNORE INTO jobs(name, model, min_cells, max_cells, weight, settings, state, created_at, history)
  VALUES ('default', 'fleet', 0, NULL, 1.0, '{}', 'active', 0, '[]');
CREATE TABLE IF NOT EXISTS job_of(
  kind TEXT NOT NULL, key TEXT NOT NULL, job TEXT NOT NULL, PRIMARY KEY(kind, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS job_of_job ON job_of(job, kind);
CREATE TABLE IF NOT EXISTS job_moves(
  id TEXT PRIMARY KEY, cell_id TEXT NOT NULL, from_job TEXT NOT NULL, to_job TEXT NOT NULL,
  state TEXT NOT NULL, reason TEXT, created_at REAL NOT NULL, finished_at REAL, history TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS job_moves_state ON job_moves(state);
CREATE INDEX IF NOT EXISTS sessions_open ON sessions(id) WHERE state = 'open';
"""

KINDS = ("cell", "session", "version", "token")
"""What a job owns, as `job_of` names it."""

JOB_STATES = ("active", "draining", "deleted")
ACTIVE_MOVE_STATES = ("draining", "loading")


@dataclass(slots=True)
class JobRow:
    name: str
    model: str
    """A model preset or a Hugging Face path (`fleet` for the implicit job: the cells' own)."""
    min_cells: int = 0
    max_cells: int | None = None
    """None: no maximum (the fleet)."""
    weight: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)
    """`objective`, `staleness_bound`, `max_sessions` (admission) … as the job was created."""
    state: str = "active"
    created_at: float = 0.0
    history: list = field(default_factory=list)

    def to_api(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "min_cells": self.min_cells, "max_cells": self.max_cells,
                "weight": self.weight, "settings": self.settings, "state": self.state,
                "created_at": self.created_at}


@dataclass(slots=True)
class MoveRow:
    id: str
    cell_id: str
    from_job: str
    to_job: str
    state: str = "draining"
    reason: str | None = None
    created_at: float = 0.0
    finished_at: float | None = None
    history: list = field(default_factory=list)

    def to_api(self) -> dict[str, Any]:
        return {"id": self.id, "cell": self.cell_id, "from": self.from_job, "to": self.to_job, "state": self.state,
                "reason": self.reason, "created_at": self.created_at, "finished_at": self.finished_at,
                "history": [list(h) for h in self.history]}


_JOB_COLS = "name, model, min_cells, max_cells, weight, settings, state, created_at, history"
_MOVE_COLS = "id, cell_id, from_job, to_job, state, reason, created_at, finished_at, history"


def _job(r: tuple) -> JobRow:
    return JobRow(r[0], r[1], r[2], r[3], r[4], loads(r[5]), r[6], r[7], loads(r[8]))


def _move(r: tuple) -> MoveRow:
    return MoveRow(*r[:8], loads(r[8]))


class JobStore:
    def __init__(self, store: Database) -> None:
        self.s = store

    # -- jobs
    def get(self, name: str) -> JobRow | None:
        r = self.s.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE name=?", (name,)).fetchone()
        return None if r is None else _job(r)

    def list(self, include_deleted: bool = False) -> list[JobRow]:
        where = "" if include_deleted else " WHERE state != 'deleted'"
        return [_job(r) for r in self.s.execute(f"SELECT {_JOB_COLS} FROM jobs{where} ORDER BY created_at, name")]

    def put(self, j: JobRow) -> None:
        self.s.execute(f"INSERT OR REPLACE INTO jobs({_JOB_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                       (j.name, j.model, j.min_cells, j.max_cells, j.weight, dumps(j.settings), j.state,
                        j.created_at, dumps(j.history[-50:])))

    # -- membership
    def job_of(self, kind: str, key: str | int) -> str:
        """The job of a cell, session, version or token (`default` when none was recorded)."""
        r = self.s.execute("SELECT job FROM job_of WHERE kind=? AND key=?", (kind, str(key))).fetchone()
        return DEFAULT_JOB if r is None else r[0]

    def jobs_of(self, kind: str, keys: Collection[str | int] | None = None) -> dict[str, str]:
        """key → job for every recorded `kind` (or those of `keys`); keys with no row are `default`."""
        if keys is None:
            return dict(self.s.execute("SELECT key, job FROM job_of WHERE kind=?", (kind,)))
        wanted, out = [str(k) for k in keys], {}
        for k in range(0, len(wanted), 500):
            part = wanted[k:k + 500]
            q = f"SELECT key, job FROM job_of WHERE kind=? AND key IN ({','.join('?' * len(part))})"
            out.update(self.s.execute(q, (kind, *part)))
        return {k: out.get(k, DEFAULT_JOB) for k in wanted}

    def members(self, kind: str, job: str) -> list[str]:
        """Keys of `kind` recorded under `job` (for `default`, only those recorded explicitly)."""
        return [r[0] for r in self.s.execute("SELECT key FROM job_of WHERE kind=? AND job=?", (kind, job))]

    def assign(self, kind: str, key: str | int, job: str) -> None:
        assert kind in KINDS, kind
        if job == DEFAULT_JOB:
            self.s.execute("DELETE FROM job_of WHERE kind=? AND key=?", (kind, str(key)))
        else:
            self.s.execute("INSERT OR REPLACE INTO job_of(kind, key, job) VALUES (?,?,?)", (kind, str(key), job))

    def assign_new(self, kind: str, key: str | int, job: str) -> None:
        """Record `job` for a key that has none yet (a key already recorded keeps its job)."""
        if job != DEFAULT_JOB:
            self.s.execute("INSERT OR IGNORE INTO job_of(kind, key, job) VALUES (?,?,?)", (kind, str(key), job))

    def any_recorded(self, kinds: tuple[str, ...]) -> bool:
        """Is anything of `kinds` recorded under a job (other than `default`)?"""
        q = f"SELECT 1 FROM job_of WHERE kind IN ({','.join('?' * len(kinds))}) LIMIT 1"
        return self.s.execute(q, kinds).fetchone() is not None

    def live_sessions(self) -> dict[str, int]:
        """job → its open sessions (the implicit job's: every open session recorded under no job)."""
        q = ("SELECT COALESCE(j.job, 'default'), COUNT(*) FROM sessions s INDEXED BY sessions_open LEFT JOIN job_of j "
             "ON j.kind = 'session' AND j.key = s.id WHERE s.state = 'open' GROUP BY 1")
        return dict(self.s.execute(q))

    def live_requests(self, job: str) -> int:
        """Requests in flight (not finished or failed) on sessions of `job`."""
        q = ("SELECT COUNT(*) FROM requests r LEFT JOIN job_of j ON j.kind = 'session' AND j.key = r.session_id "
             "WHERE r.state NOT IN ('finished', 'failed') AND COALESCE(j.job, 'default') = ?")
        return self.s.execute(q, (job,)).fetchone()[0]

    def requests_in(self, job: str, states: Collection[str]) -> int:
        """Requests of `job`'s sessions in one of `states` (the staleness bound's work in flight)."""
        st = list(states)
        q = ("SELECT COUNT(*) FROM requests r LEFT JOIN job_of j ON j.kind = 'session' AND j.key = r.session_id "
             f"WHERE r.state IN ({','.join('?' * len(st))}) AND COALESCE(j.job, 'default') = ?")
        return self.s.execute(q, (*st, job)).fetchone()[0]

    def finished_after(self, job: str, cursor: int) -> int:
        """`job`'s finished sessions past `cursor` (its trajectories its trainer has not fetched)."""
        q = ("SELECT COUNT(*) FROM sessions s LEFT JOIN job_of j ON j.kind = 'session' AND j.key = s.id "
             "WHERE s.finish_seq > ? AND COALESCE(j.job, 'default') = ?")
        return self.s.execute(q, (cursor, job)).fetchone()[0]

    # -- moves between jobs
    def get_move(self, move_id: str) -> MoveRow | None:
        r = self.s.execute(f"SELECT {_MOVE_COLS} FROM job_moves WHERE id=?", (move_id,)).fetchone()
        return None if r is None else _move(r)

    def list_moves(self, active_only: bool = False, limit: int = 100) -> list[MoveRow]:
        if active_only:
            q = f"SELECT {_MOVE_COLS} FROM job_moves WHERE state IN (?,?) ORDER BY created_at, id"
            return [_move(r) for r in self.s.execute(q, ACTIVE_MOVE_STATES)]
        q = f"SELECT {_MOVE_COLS} FROM job_moves ORDER BY created_at DESC, id LIMIT ?"
        return [_move(r) for r in self.s.execute(q, (limit,))]

    def active_move_for(self, cell_id: str) -> MoveRow | None:
        q = f"SELECT {_MOVE_COLS} FROM job_moves WHERE cell_id=? AND state IN (?,?)"
        r = self.s.execute(q, (cell_id, *ACTIVE_MOVE_STATES)).fetchone()
        return None if r is None else _move(r)

    def put_move(self, m: MoveRow) -> None:
        self.s.execute(f"INSERT OR REPLACE INTO job_moves({_MOVE_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                       (m.id, m.cell_id, m.from_job, m.to_job, m.state, m.reason, m.created_at, m.finished_at,
                        dumps(m.history[-50:])))

    def count_moves(self, state: str = "done") -> int:
        return self.s.execute("SELECT COUNT(*) FROM job_moves WHERE state=?", (state,)).fetchone()[0]


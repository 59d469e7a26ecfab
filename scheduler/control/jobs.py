"""RL jobs on one fleet: create, list, drain and delete; which job a caller, a session, a
version and a cell belong to; per-job admission; the fleet divided between jobs.

A job is `active` (takes new sessions), `draining` (`DELETE /v1/jobs/{name}`: no new session,
the turns in flight finish; its open sessions may run turns until `drain_s` has passed) or
`deleted` (no request of it in flight; its cells return to the implicit job `default`).
The implicit job `default` is always there and cannot be deleted: a fleet that never names a
job serves it alone, exactly as before jobs existed.

Caller rules (the token's job, scheduler/api/principal.py): an admin token acts on any job; an
agent or trainer token acts on its own job only (another job's sessions and versions do not
exist for it). The gateway's OpenAI `model` field names the job (`resolve`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import CellflipError, Conflict, Invalid, NoCapacity, NotFound
from scheduler.control import jobmodels, jobsettings
from scheduler.planner.jobs import JobShare, JobShareError, divide, moves
from scheduler.store.jobs import DEFAULT_JOB, JobRow

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.planner.types import Snapshot

log = logging.getLogger("cellflip.scheduler")

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
"""A job's name: what clients put in the OpenAI `model` field, and a Prometheus label value."""

DRAIN_S = 600.0
"""How long a draining job's open sessions may still run turns (a job's `drain_s` setting)."""

STEP_EVERY_S = 1.0
"""The jobs' tick (drains finished, the fleet's division) runs at most this often: it counts
open sessions per job, a pass over the open sessions."""



class Forbidden(CellflipError):
    """A job-bound token used on another job."""

    status = 403
    code = "wrong_job"


class Jobs:
    """Owns `targets` (the last division of the fleet between jobs) and `planned_moves`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.targets: dict[str, int] = {}
        """job → cells the planner's last division gave it."""
        self.planned_moves: list[tuple[str, str]] = []
        """(from job, to job) per cell the last division would move."""
        self._last_step = float("-inf")
        self._refused: str | None = None
        """The planner's last refusal of the division (logged once)."""
        self.moves: Any = None
        """The moves between jobs (scheduler/control/jobmoves.py `JobMoves`), set by the controller."""
        self.planner: Any = None
        """Each job's own snapshot, demand and flips (scheduler/control/jobplan.py `JobPlanner`),
        set by the controller."""
        self.auto_move = True
        """Carry out the division's moves (off: the division is only reported)."""
        self._members: dict[str, frozenset[str]] | None = None
        """job → the cells recorded under it (jobs other than `default`); None: read it again."""
        self._containers: dict[str, Any] = {}
        """job → the container `placeable` answers for it (one object per job until a cell moves)."""
        ctx.placeable = self.placeable

    # ------------------------------------------------------------------ placement
    def placeable(self, session_id: str | None, cell_id: str | None) -> Any:
        """The cells a request of `session_id` (or leaving `cell_id`) may go to: its job's cells.
        None while the fleet serves one job (no cell recorded under another job): any cell."""
        members = self._read_members()
        if not members:
            return None
        store = self.ctx.store.jobs
        job = store.job_of("session", session_id) if session_id is not None else store.job_of("cell", cell_id or "")
        kept = self._containers.get(job)
        if kept is None:
            if job == DEFAULT_JOB:
                kept = _Except(frozenset().union(*members.values()))
            else:
                kept = members.get(job, frozenset())
            self._containers[job] = kept
        return kept

    def foreign_cells(self, cell_id: str | None, job: str | None) -> frozenset[str]:
        """The cells of jobs other than `job` (none when `job` is None or the fleet serves one
        job); 403 `wrong_job` when `cell_id` is one of them."""
        members = self._read_members()
        if job is None or (not members and job == DEFAULT_JOB):
            return frozenset()
        other = frozenset().union(*(cells for j, cells in members.items() if j != job))
        if job != DEFAULT_JOB:
            other |= {r.cell_id for r in self.ctx.store.fleet.planning_rows()} - members.get(job, frozenset())
        if cell_id is not None and cell_id in other:
            raise Forbidden(f"cell {cell_id} serves another job than {job!r}")
        return other

    def _read_members(self) -> dict[str, frozenset[str]]:
        if self._members is None:
            out: dict[str, set[str]] = {}
            for cid, job in self.ctx.store.jobs.jobs_of("cell").items():
                out.setdefault(job, set()).add(cid)
            self._members = {j: frozenset(c) for j, c in out.items()}
            self._containers = {}
        return self._members

    def members(self) -> dict[str, frozenset[str]]:
        """job → the cells recorded under it (jobs other than `default`; empty: one job)."""
        return self._read_members()

    def forget_members(self) -> None:
        """A cell's job changed: `placeable` reads the membership again."""
        self._members = None

    # ------------------------------------------------------------------ reads
    def require(self, name: str) -> JobRow:
        row = self.ctx.store.jobs.get(name)
        if row is None or row.state == "deleted":
            known = ", ".join(j.name for j in self.ctx.store.jobs.list())
            raise NotFound(f"unknown job {name!r} (jobs: {known})", code="unknown_job")
        return row

    def check_access(self, job: str, caller_job: str | None) -> None:
        """`caller_job`: the token's job (None: admin, or auth off — any job)."""
        if caller_job is not None and caller_job != job:
            raise Forbidden(f"this token belongs to job {caller_job!r}, not {job!r}")

    def resolve(self, model: str | None, caller_job: str | None) -> str:
        """The job a chat turn is for: the job its `model` field names; a `model` naming no job
        (e.g. `cellflip`, or none) means the caller's own job, or `default` when only that job
        exists. 404 `unknown_job` when several jobs exist and neither tells which; 403
        `wrong_job` for another job's name under a job-bound token."""
        store = self.ctx.store.jobs
        row = store.get(model) if model else None
        if row is not None and row.state != "deleted":
            self.check_access(row.name, caller_job)
            return row.name
        if caller_job is not None:
            return caller_job
        names = [j.name for j in store.list()]
        if names == [DEFAULT_JOB]:
            return DEFAULT_JOB
        raise NotFound(f"model {model!r} names no job; set it to one of: {', '.join(names)}", code="unknown_job")

    def session_job(self, session_id: str) -> str:
        return self.ctx.store.jobs.job_of("session", session_id)

    # ------------------------------------------------------------------ admission
    def admit_session(self, job: str, session_id: str, is_new: bool) -> None:
        """A turn of `job` on `session_id`: a new session only while the job is active and under
        its `max_sessions`; a turn of a draining job's open session only within its `drain_s`."""
        row = self.require(job)
        try:
            self._admit(row, session_id, is_new)
        except CellflipError as e:
            self.ctx.metrics.job_sessions_refused.labels(job, e.code).inc()
            raise

    def _admit(self, row: JobRow, session_id: str, is_new: bool) -> None:
        job = row.name
        if is_new:
            if row.state != "active":
                raise Conflict(f"job {job!r} is draining: it takes no new sessions", code="job_draining")
            cap = row.settings.get("max_sessions")
            if cap is not None:
                live = self.ctx.store.jobs.live_sessions().get(job, 0)
                if live >= int(cap):
                    raise NoCapacity(f"job {job!r} has {live} open sessions (max_sessions {cap})", code="job_full")
            return
        if self.session_job(session_id) != job:
            raise Forbidden(f"session {session_id!r} belongs to another job than {job!r}")
        if row.state == "draining" and time.time() > _drained_at(row) + float(row.settings.get("drain_s", DRAIN_S)):
            raise Conflict(f"job {job!r} is draining and its drain time is over", code="job_draining")

    def tag_session(self, session_id: str, job: str, new: bool = False) -> None:
        """Record a session's job: a `new` one (no session row yet) gets `job`, whatever an earlier
        refused turn recorded; one already recorded keeps its own."""
        with self.ctx.txn(durable=False):
            if new:
                self.ctx.store.jobs.assign("session", session_id, job)
            else:
                self.ctx.store.jobs.assign_new("session", session_id, job)

    def admit_turn(self, job: str, session_id: str | None, idempotency_key: str | None) -> str | None:
        """A `/v1/generate` turn of `job`: admitted (`admit_session`) and, for a new session, its
        job recorded before it is placed (placement reads it). A new session of a job other than
        `default` with no id gets one here (from the Idempotency-Key when given, so a replay
        names the same session); returns the session id to submit with (None: the fleet's own)."""
        is_new = session_id is None or self.ctx.store.sessions.get(session_id) is None
        self.admit_session(job, session_id or "", is_new)
        if session_id is None and job != DEFAULT_JOB:
            seed = idempotency_key or uuid.uuid4().hex
            session_id = f"anon-{hashlib.sha256(f'{job}/{seed}'.encode()).hexdigest()[:16]}"
        if session_id is not None and is_new:
            self.tag_session(session_id, job, new=True)
        return session_id

    # ------------------------------------------------------------------ create, list, delete
    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        name = spec["name"]
        if not NAME_RE.match(name):
            raise Invalid(f"job name {name!r}: lower-case letters, digits, '.', '_', '-' (at most 63)")
        lo, hi = int(spec.get("min_cells", 0)), spec.get("max_cells")
        if hi is not None and int(hi) < lo:
            raise Invalid(f"max_cells {hi} is below min_cells {lo}")
        jobsettings.check(spec.get("settings") or {}, None if hi is None else int(hi))
        store = self.ctx.store.jobs
        with self.ctx.txn(durable=True):
            old = store.get(name)
            if old is not None and old.state != "deleted":
                raise Conflict(f"job {name!r} exists ({old.state})", code="job_exists")
            row = JobRow(name, spec["model"], lo, None if hi is None else int(hi), float(spec.get("weight", 1.0)),
                         dict(spec.get("settings") or {}), "active", time.time(), [("active", time.time(), "created")])
            store.put(row)
        self.ctx.kick()
        return self.view(name)

    def update(self, name: str, settings: dict[str, Any]) -> dict[str, Any]:
        """`PATCH /v1/jobs/{name}`: `settings` merged over the job's own (a key set to null returns
        to the fleet's default), checked whole first (422: nothing changed)."""
        with self.ctx.txn(durable=True):
            row = self.require(name)
            row.settings = jobsettings.merged(row.settings, settings, row.max_cells)
            row.history.append(("settings", time.time(), ", ".join(sorted(settings))))
            self.ctx.store.jobs.put(row)
        self.ctx.kick()
        return self.view(name)

    def view(self, name: str) -> dict[str, Any]:
        row = self.require(name)
        return self._to_api(row, self._cells_by_job(), self._versions_by_job(), self.ctx.store.jobs.live_sessions())

    def list_view(self) -> dict[str, Any]:
        cells, vers, live = self._cells_by_job(), self._versions_by_job(), self.ctx.store.jobs.live_sessions()
        out = [self._to_api(r, cells, vers, live) for r in self.ctx.store.jobs.list()]
        return {"jobs": out, "moves": [m.to_api() for m in self.ctx.store.jobs.list_moves(limit=20)]}

    def _to_api(self, row: JobRow, cells: dict, vers: dict, live: dict) -> dict[str, Any]:
        return {**row.to_api(), "cells": sorted(cells.get(row.name, [])), "versions": vers.get(row.name, []),
                "open_sessions": live.get(row.name, 0), "target_cells": self.targets.get(row.name),
                "model_cells": self._model_cells(row), "trainer": jobsettings.trainer_view(self.ctx.cfg, row)}

    def _model_cells(self, row: JobRow) -> int:
        """Live cells that run the job's model (0: none yet; the job's target stays 0)."""
        fleet = jobmodels.fleet_model(self.ctx.store)
        caps = [jobmodels.cell_model(r.capabilities) for r in self.ctx.store.fleet.planning_rows()]
        return jobmodels.count_compatible(row, caps, fleet)

    def _cells_by_job(self) -> dict[str, list[str]]:
        store = self.ctx.store
        ids = [r.cell_id for r in store.fleet.planning_rows()]
        out: dict[str, list[str]] = {}
        for cid, job in store.jobs.jobs_of("cell", ids).items():
            out.setdefault(job, []).append(cid)
        return out

    def _versions_by_job(self) -> dict[str, list[int]]:
        rows = self.ctx.store.fleet.list_versions()
        out: dict[str, list[int]] = {}
        for v, job in self.ctx.store.jobs.jobs_of("version", [r.v for r in rows]).items():
            out.setdefault(job, []).append(int(v))
        return out

    def versions_of(self, job: str) -> set[int]:
        rows = self.ctx.store.fleet.list_versions()
        return {int(v) for v, j in self.ctx.store.jobs.jobs_of("version", [r.v for r in rows]).items() if j == job}

    def delete(self, name: str) -> dict[str, Any]:
        """Start draining `name` (idempotent); it is deleted once nothing of it is in flight."""
        if name == DEFAULT_JOB:
            raise Conflict("the implicit job 'default' cannot be deleted", code="default_job")
        store = self.ctx.store.jobs
        with self.ctx.txn(durable=True):
            row = self.require(name)
            if row.state == "active":
                row.state = "draining"
                row.history.append(("draining", time.time(), "delete requested"))
                store.put(row)
        self.ctx.kick()
        return self.view(name)

    # ------------------------------------------------------------------ the tick
    def step(self) -> bool:
        """Carry moves between jobs on; finish draining jobs with nothing in flight; divide
        the fleet between the jobs, and start the first move the division asks for; on a fleet
        shared by several jobs, each job's own flips. One read of the cells (`JobPlanner`) for
        both decisions. Returns whether the flips were planned here (per job)."""
        if self.moves is not None:
            self.moves.step()
        shared = self.planner is not None and bool(self._read_members())
        now = self.ctx.clock()
        due = now - self._last_step >= STEP_EVERY_S
        if not (due or shared):
            return False
        store = self.ctx.store.jobs
        rows = store.list()
        snaps = None
        if self.planner is not None and (shared or len(rows) > 1):
            snaps = self.planner.snapshots([r.name for r in rows], self._read_members())
        if due:
            self._last_step = now
            for row in rows:
                if row.state == "draining" and store.live_requests(row.name) == 0:
                    self._finish_delete(row)
            self.divide(snaps)
            if self.moves is not None and self.auto_move:
                self.moves.plan(self.planned_moves)
        if shared and snaps is not None:
            self.planner.flip(snaps)
        return shared

    def _finish_delete(self, row: JobRow) -> None:
        store = self.ctx.store.jobs
        with self.ctx.txn(durable=True):
            row.state = "deleted"
            row.history.append(("deleted", time.time(), "drained: nothing in flight"))
            store.put(row)
            for cid in store.members("cell", row.name):
                store.assign("cell", cid, DEFAULT_JOB)
        self.forget_members()

    def divide(self, snaps: dict[str, Snapshot] | None = None) -> dict[str, int]:
        """The planner's division of the fleet's live cells between the active jobs, from each
        job's demand (open sessions over the slots a cell offers, plus its training cells from
        `snaps`, each job's snapshot); kept as `targets`. Each job's min and max are capped by
        the live cells of its model. A fleet serving `default` alone has nothing to divide."""
        store, m = self.ctx.store, self.ctx.metrics
        rows = store.fleet.planning_rows()
        active = [j for j in store.jobs.list() if j.state == "active"]
        if [j.name for j in active] == [DEFAULT_JOB] and not store.jobs.any_recorded(("cell",)):
            self.targets, self.planned_moves = {DEFAULT_JOB: len(rows)}, []
            m.job_target_cells.labels(DEFAULT_JOB).set(len(rows))
            m.job_cells.labels(DEFAULT_JOB).set(len(rows))
            return self.targets
        recorded = store.jobs.jobs_of("cell")
        held = Counter(recorded.get(r.cell_id, DEFAULT_JOB) for r in rows)
        slots = max(1, int(sum(r.max_running for r in rows) / max(1, len(rows))))
        live = store.jobs.live_sessions()
        try:
            self.targets = divide(self._shares(active, rows, held, live, slots, snaps), len(rows))
            self.planned_moves = moves(self.targets, {n: held.get(n, 0) for n in set(held) | set(self.targets)})
        except JobShareError as e:  # e.g. the jobs' min_cells sum past the fleet: nothing moves
            if str(e) != self._refused:
                log.warning("the fleet's division between jobs is refused: %s", e)
            self._refused, self.targets, self.planned_moves = str(e), {}, []
            return self.targets
        self._refused = None
        for name, t in self.targets.items():
            m.job_target_cells.labels(name).set(t)
            m.job_cells.labels(name).set(held.get(name, 0))
            m.job_open_sessions.labels(name).set(live.get(name, 0))
        return self.targets

    def _shares(self, active: list[JobRow], rows: list, held: Counter, live: dict[str, int], slots: int,
                snaps: dict[str, Snapshot] | None) -> list[JobShare]:
        """Each active job's `JobShare`: min and max capped by the cells of its model, demand
        from its open sessions and (with `snaps`) its training."""
        fleet = jobmodels.fleet_model(self.ctx.store)
        models = [jobmodels.cell_model(r.capabilities) for r in rows]
        out = []
        for j in active:
            fit = jobmodels.count_compatible(j, models, fleet)
            hi = min(fit, len(rows) if j.max_cells is None else j.max_cells)
            n = live.get(j.name, 0)
            want = (self.planner.demand(j.name, (snaps or {}).get(j.name), n, slots)
                    if snaps is not None and self.planner is not None else math.ceil(n / slots))
            out.append(JobShare(j.name, min(j.min_cells, hi), hi, j.weight, want, held.get(j.name, 0)))
        return out


def _drained_at(row: JobRow) -> float:
    return next((h[1] for h in reversed(row.history) if h[0] == "draining"), row.created_at)


class _Except:
    """Every cell but those of `other` (the implicit job's cells on a fleet shared with others)."""

    __slots__ = ("other",)

    def __init__(self, other: frozenset[str]) -> None:
        self.other = other

    def __contains__(self, cell_id: object) -> bool:
        return cell_id not in self.other

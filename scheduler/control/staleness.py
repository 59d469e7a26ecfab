"""The staleness bound (AReaL's bound on off-policyness), in versions = published RL updates.

Two rules share `scheduler.staleness_bound` (the planner reads the same field):

    admission   a NEW session gets 429 (reason `staleness_bound`) while the sessions in flight,
                the finished ones the trainer has not fetched and the fetched ones it has not
                trained yet (its report's `untrained`) reach (bound + 1) × the trainer's batch
                size: work admitted now would otherwise be trained more than
                `bound` updates after it started. Later turns of admitted sessions always pass.
                Until the trainer has declared its batch size (POST /v1/trainer/report) the
                rule has no unit and admits.
    hand-out    at GET /v1/trajectories, a trajectory's staleness is the number of published
                versions newer than its oldest sampled token's version. Past the bound it
                follows `staleness_policy`: `correct` hands it out (the decoupled objective's
                staleness weight min(r_stale, C_s) corrects it), `drop` hands out only a record
                saying so (`dropped: "stale"`, no tokens; the trainer drops its whole group).

Counted either way, never silent: `cellflip_stale_trajectories_total{policy}`,
`cellflip_admission_staleness_paused_total`, `cellflip_trajectory_staleness_max`, and the
`staleness` block of GET /v1/versions.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import NoCapacity
from scheduler.control import jobsettings
from scheduler.store.jobs import DEFAULT_JOB

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.rates import Rates

IN_FLIGHT_STATES = ("queued", "running", "migrating", "suspended", "parked")
"""Request states of a session still being rolled out."""


def versions_behind(published: list[int], version: int) -> int:
    """Published versions newer than `version` (`published` sorted ascending)."""
    return len(published) - bisect.bisect_right(published, version)


def trajectory_staleness(published: list[int], traj: dict[str, Any]) -> int:
    """Versions between a trajectory's oldest sampled token and the newest published version
    (0 without sampled tokens)."""
    sampled = [v for m, v in zip(traj["loss_mask"], traj["versions"], strict=True) if m and v is not None]
    return versions_behind(published, min(sampled)) if sampled else 0


class Staleness:
    """The two rules, and the trajectories the trainer has fetched. Owns the hand-out cursor
    and the rules' counters since this scheduler started (reported by GET /v1/versions)."""

    def __init__(self, ctx: Context, rates: Rates) -> None:
        self.ctx = ctx
        self.rates = rates
        self.trajectory_cursor = 0
        """Highest trajectory cursor a trainer has fetched (the rest wait for training)."""
        self.cursors: dict[str, int] = {}
        """RL job → the cursor its trainer fetched up to (the implicit job's: also a trainer bound
        to no job, which reports as its trainer)."""
        self.handed_out = 0
        """Trajectories handed out (all)."""
        self.stale_corrected = 0
        """Past the bound, handed out to be trained with correction weights."""
        self.stale_dropped = 0
        """Past the bound, handed out as dropped."""
        self.untrusted_dropped = 0
        """Handed out as dropped because a quarantined cell sampled some of them."""
        self.max_seen = 0
        """Largest staleness of a trajectory handed out."""
        self.admission_paused = 0
        """New sessions refused by the admission rule."""

    def bound_of(self, job: str | None) -> int:
        """`job`'s staleness bound: its `settings.staleness_bound`, else the fleet's."""
        return jobsettings.staleness_bound(self.ctx.cfg, self.ctx.store.jobs.get(job) if job is not None else None)

    def admission_limit(self, job: str | None = None) -> int | None:
        """(bound + 1) × the trainer's batch size, or None before the trainer declared one.
        `job`: that job's bound and its own trainer's batch (None: the fleet's, as one job)."""
        demand = self.rates.trainer(job).demand
        if demand is None:
            return None
        bound = self.ctx.cfg.staleness_bound if job is None else self.bound_of(job)
        return (bound + 1) * demand.batch_size

    def cursor_of(self, job: str) -> int:
        """The cursor `job`'s trainer fetched up to."""
        return self.cursors.get(job, 0)

    def finished_waiting(self, job: str | None = None) -> int:
        """Finished sessions the trainer has not fetched (`job`: that job's, past its cursor)."""
        if job is None:
            return self.ctx.store.sessions.finished_after(self.trajectory_cursor)
        return self.ctx.store.jobs.finished_after(job, self.cursor_of(job))

    def untrained_work(self, job: str | None = None) -> int:
        """Sessions in flight, finished sessions the trainer has not fetched, and fetched
        ones it reported as not yet trained (`job`: that job's only, against its trainer)."""
        demand = self.rates.trainer(job).demand
        held = demand.untrained if demand is not None else 0
        if job is not None:
            return self.ctx.store.jobs.requests_in(job, IN_FLIGHT_STATES) + self.finished_waiting(job) + held
        counts = self.ctx.store.owners.count_requests()
        return sum(counts.get(s, 0) for s in IN_FLIGHT_STATES) + self.finished_waiting() + held

    def check_admission(self, session_id: str | None) -> None:
        """Raise NoCapacity (429, code `staleness_bound`) for a new session the bound holds back.
        On a fleet shared by several jobs, the session's job's bound, counted in its own work."""
        ctx = self.ctx
        if session_id is not None and ctx.store.owners.has_requests(session_id):
            return  # a later turn of an admitted session (the gateway creates the session first)
        jobs = ctx.store.jobs
        job = jobs.job_of("session", session_id) if session_id and jobs.any_recorded(("session",)) else None
        limit = self.admission_limit(job)
        if limit is None:
            return
        work = self.untrained_work(job)
        if work < limit:
            return
        self.admission_paused += 1
        ctx.metrics.admission_stale.inc()
        of = "" if job is None else f" of job {job!r}"
        raise NoCapacity(f"staleness bound: {work} sessions{of} in flight, or finished and not yet trained, "
                         f"limit (staleness_bound + 1) x batch = {limit}", code="staleness_bound",
                         retry_after_s=max(1.0, ctx.cfg.heartbeat_s * 2))

    def hand_out(self, cursor: int, limit: int, job: str | None = None) -> dict[str, Any]:
        """GET /v1/trajectories: finished sessions past `cursor`, each with its staleness and
        the policy applied; the trainer's cursor advances to what it fetched. With `job` (a
        job-bound trainer, on a fleet shared by several jobs), that job's only, their staleness
        counted in its own lineage against its own bound and policy, and its own cursor advanced."""
        items, nxt = self.ctx.store.sessions.trajectories(cursor, limit)
        jobs = self.ctx.store.jobs
        published, bound = None, self.ctx.cfg.staleness_bound
        if job is not None and jobs.any_recorded(("session", "version")):
            mine = jobs.jobs_of("session", [t["id"] for t in items])
            items = [t for t in items if mine[t["id"]] == job]
            versions = jobs.jobs_of("version", [r.v for r in self.ctx.store.fleet.list_versions()])
            published = sorted(int(v) for v, j in versions.items() if j == job)
            self.cursors[job] = max(self.cursor_of(job), nxt)
        elif job is None or job == DEFAULT_JOB:
            self.cursors[DEFAULT_JOB] = max(self.cursor_of(DEFAULT_JOB), nxt)
        self.trajectory_cursor = max(self.trajectory_cursor, nxt)  # the one-job fleet's (as before jobs)
        policy = self.ctx.cfg.staleness_policy
        if job is not None:
            row = jobs.get(job)
            bound, policy = self.bound_of(job), jobsettings.staleness_policy(self.ctx.cfg, row)
        return {"trajectories": self._apply(items, published, bound, policy), "next_cursor": nxt}

    def _apply(self, items: list[dict[str, Any]], published: list[int] | None, bound: int,
               policy: str) -> list[dict[str, Any]]:
        """Annotate each trajectory with its `staleness` (versions) and apply `policy` to those
        past `bound`; returns the list to hand out (same order, same length).
        `published`: the versions to count in (None: every published version)."""
        ctx = self.ctx
        if published is None:
            published = sorted(r.v for r in ctx.store.fleet.list_versions())
        out = []
        for t in items:
            k = trajectory_staleness(published, t)
            self.handed_out += 1
            if k > self.max_seen:
                self.max_seen = k
                ctx.metrics.staleness_max.set(k)
            t = {**t, "staleness": k}
            if ctx.store.sessions.tainted(t["id"]):  # a quarantined cell sampled some of it
                self.untrusted_dropped += 1
                out.append({"id": t["id"], "state": t["state"], "reward": t["reward"], "group_id": t["group_id"],
                            "staleness": k, "dropped": "untrusted"})
                continue
            if k > bound:
                ctx.metrics.stale_trajectories.labels(policy).inc()
                if policy == "drop":
                    self.stale_dropped += 1
                    t = {"id": t["id"], "state": t["state"], "reward": t["reward"], "group_id": t["group_id"],
                         "staleness": k, "dropped": "stale"}
                else:
                    self.stale_corrected += 1
            out.append(t)
        return out

    def to_api(self) -> dict[str, Any]:
        """The `staleness` block of GET /v1/versions."""
        cfg = self.ctx.cfg
        return {"bound": cfg.staleness_bound, "policy": cfg.staleness_policy,
                "trajectories_handed_out": self.handed_out, "stale_corrected": self.stale_corrected,
                "stale_dropped": self.stale_dropped, "untrusted_dropped": self.untrusted_dropped,
                "max_seen": self.max_seen,
                "admission_limit": self.admission_limit(), "admission_paused": self.admission_paused}

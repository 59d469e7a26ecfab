"""Weight versions on a fleet shared by several RL jobs: each job's own lineage.

Versions are one integer space (a version id is unique across jobs) but each belongs to one job
(`job_of`, the publishing trainer token's job): a job's target is its own newest published
version; its rollout cells, and only they, are told to load it, and it becomes active once they
all serve it (older active versions of that job only start retiring). While no cell and no
version is recorded under a job other than `default` (`multi` false), `Versions` runs its
one-lineage path unchanged; these are the paths it takes otherwise. They walk the fleet's
live cells (O(cells) a tick), which a one-job fleet never pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.contract.protocol import LoadVersionCmd
from scheduler.contract.states import VERSION, set_state

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.store.fleet import VersionRow

SERVING_STATES = ("rollout", "draining", "loading")


class JobLineages:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def multi(self) -> bool:
        """A cell or a version is recorded under a job other than `default`."""
        return self.ctx.store.jobs.any_recorded(("cell", "version"))

    def job_of_cell(self, cell_id: str) -> str:
        return self.ctx.store.jobs.job_of("cell", cell_id)

    def job_of_version(self, version: int) -> str:
        return self.ctx.store.jobs.job_of("version", version)

    def lineage(self, rows: list[VersionRow], job: str) -> list[VersionRow]:
        """`rows` of `job`'s versions."""
        jobs = self.ctx.store.jobs.jobs_of("version", [r.v for r in rows])
        return [r for r in rows if jobs[str(r.v)] == job]

    def target(self, rows: list[VersionRow], job: str) -> VersionRow | None:
        mine = [r for r in self.lineage(rows, job) if r.state in ("broadcasting", "active") and r.source]
        return max(mine, key=lambda r: r.v) if mine else None

    def rollout_cells(self, cells: list[str], job: str) -> list[str]:
        jobs = self.ctx.store.jobs.jobs_of("cell", cells)
        return [c for c in cells if jobs[c] == job]

    def catch_up(self, versions: Any) -> None:
        """Every serving cell that lags its own job's target is told to fetch it (again after
        `load_timeout_s`)."""
        ctx = self.ctx
        rows = ctx.store.fleet.list_versions()
        served = versions.served
        served.refresh()
        served.dirty.clear()
        cells = [cid for cid, (state, _, seen) in served.cells.items() if state in SERVING_STATES and seen]
        jobs = ctx.store.jobs.jobs_of("cell", cells)
        targets = {job: self.target(rows, job) for job in set(jobs.values())}
        now, timeout, policy = ctx.clock(), ctx.ver_cfg.load_timeout_s, ctx.ver_cfg.inflight_policy
        for cell_id in sorted(cells):
            t = targets[jobs[cell_id]]
            s = ctx.registry.live[cell_id].summary
            if t is None or s is None or s.version == t.v or t.v in s.loading:
                continue
            if now - versions.version_sent.get((cell_id, t.v), float("-inf")) < timeout:
                continue
            versions.version_sent[(cell_id, t.v)] = now
            v, source = t.v, t.source
            ctx.registry.send(cell_id, lambda i, v=v, source=source: LoadVersionCmd(i, v, source, "fetch", True,
                                                                                     policy))

    def progress(self, versions: Any) -> None:
        """A broadcast version is active once every seen live rollout cell of its job serves it;
        then its job's older active versions start retiring."""
        ctx = self.ctx
        rows = ctx.store.fleet.list_versions()
        pending = sorted((r for r in rows if r.state == "broadcasting"), key=lambda r: r.v)
        if not pending:
            return
        served = versions.served
        served.refresh()
        rollout = [cid for cid, (state, _, seen) in served.cells.items() if state == "rollout" and seen]
        jobs = ctx.store.jobs.jobs_of("cell", rollout)
        vjobs = ctx.store.jobs.jobs_of("version", [r.v for r in rows])
        for row in pending:
            job = vjobs[str(row.v)]
            if any(served.cells[c][1] != row.v for c in rollout if jobs[c] == job):
                continue
            with ctx.txn(durable=True):
                set_state(VERSION, row, "active", f"every rollout cell of job {job} serves it")
                ctx.store.fleet.put_version(row)
                for old in rows:
                    if old.v < row.v and old.state == "active" and vjobs[str(old.v)] == job:
                        set_state(VERSION, old, "retiring", f"version {row.v} active")
                        ctx.store.fleet.put_version(old)

"""The controller: composes the control plane's concerns around one shared context.

One tick:  sync_from() (passive: leases, versions, gauges)  →  step_next() (active: flips,
migrations, placement) — the second only once the inventory is rebuilt after a start.

On start the controller rebuilds from the store: every cell not `down` gets a lease of
`lease_s` (the grace) and must sync or re-register within it; until every such cell has done
so (or the grace ran out and the silent ones were fenced) nothing active happens. Then the
reconciler is level-triggered: it compares what the store says with what cells report, so an
unfinished flip simply continues (or rolls back) from where the store says it is.

Each concern owns its state and the methods that change it (see `Controller.__init__` for
which holds what); handlers call the thin methods below.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any

from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig, VersionsConfig
from scheduler.contract.errors import Conflict
from scheduler.contract.gcpolicy import SCHEDULER_YOUNG_THRESHOLD, GcPolicy
from scheduler.contract.protocol import (
    AbortMigrationRequest,
    CommitRequest,
    CommitResponse,
    RegisterRequest,
    RegisterResponse,
    SyncRequest,
    SyncResponse,
)
from scheduler.contract.records import StoredTokens
from scheduler.contract.sampling import SamplingParams
from scheduler.control.cellsync import Membership
from scheduler.control.completions import Completions
from scheduler.control.context import TICK_KEY, Context, Effects
from scheduler.control.exports import Exports
from scheduler.control.flips import Flips
from scheduler.control.ingest import Ingest
from scheduler.control.jobfloor import JobFloor
from scheduler.control.jobmoves import JobMoves
from scheduler.control.jobplan import JobPlanner
from scheduler.control.jobs import Jobs
from scheduler.control.metrics import Metrics
from scheduler.control.migrations import Migrations
from scheduler.control.ownership import Ownership
from scheduler.control.rates import Rates, TrainerDemand
from scheduler.control.reconcile import Concerns, Reconciler
from scheduler.control.scoring import Scoring
from scheduler.control.snapshot import CellSummaries, build_snapshot
from scheduler.control.staleness import Staleness
from scheduler.control.tally import FleetTally
from scheduler.control.trust import Trust
from scheduler.control.versions import Versions
from scheduler.planner.room import Placement
from scheduler.planner.types import Snapshot
from scheduler.store import Store
from scheduler.store.owners import RequestRow

log = logging.getLogger("cellflip.scheduler")

SLOW_TICK_S = 0.02
"""A tick longer than this is followed by a rest as long as itself (`Controller.run`)..."""
MAX_REST_S = 2.0
"""...up to this long."""
MIN_TICK_GAP_S = 0.05
"""Least time from one tick's start to the next's: a burst of kicks (flip requests, new
sessions) is served by a tick every 50 ms, not by one tick per request."""
REST_KEY = ("control loop", "rest")


class Controller:
    def __init__(self, store: Store, cfg: SchedulerConfig, migration: MigrationConfig | None = None,
                 *, clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None,
                 versions: VersionsConfig | None = None) -> None:
        ctx = self.ctx = Context(store, cfg, migration or MigrationConfig(), versions or VersionsConfig(),
                                 metrics or Metrics(), clock)
        self.rates = Rates()
        """Finish rate, slot occupancy and training speed as measured here (the planner's inputs)."""
        self.cell_summaries = CellSummaries(ctx)
        """The snapshot's per-cell summaries, re-read only where the store or registry changed."""
        self.trust = Trust(ctx)
        """The fleet's model limits and each cell's trust; quarantine."""
        self.scoring = Scoring(ctx, self.trust)
        """Scoring tasks, scoring-only fetches, version drops and final passes."""
        self.versions = Versions(ctx, self.scoring)
        """Which cell was told to load which version, when."""
        self.migrations = Migrations(ctx, self.versions, self.trust)
        """When each pending KV copy began; each move's client-visible stall."""
        self.ownership = Ownership(ctx, self.migrations, self.snapshot, self.placement)
        """Each request's progress clock and the cell a stalled request avoids."""
        self.tally = FleetTally(ctx)
        """Rollout slots, live rollout cells and role-seconds, kept by change; the fleet's
        Prometheus families at scrape."""
        self.flips = Flips(ctx, self.ownership, self.migrations, self.versions, self.scoring, self.snapshot, self.tally,
                           self.trust)
        """Drain deadlines and the cells an explicit flip pinned in training."""
        self.staleness = Staleness(ctx, self.rates)
        """The trajectory cursor and the staleness rules' counters."""
        self.completions = Completions(ctx, self.ownership, self.staleness, self.snapshot, self.trust)
        self.exports = Exports(ctx, self.trust)
        """Weight exports asked of the cells holding a version (kept in memory)."""
        ingest = Ingest(ctx, self.ownership, self.migrations, self.scoring, self.flips, self.trust, self.exports)
        self.membership = Membership(ctx, self.versions, ingest, self.trust,
                                     holders=(self.migrations, self.ownership, self.flips, self.scoring, self.versions))
        """Register, sync, fence; fencing asks each holder above in that order."""
        self.trust.quarantine_cell = self.membership.fence_in_tx
        self.trust.requeue_request = self.ownership.revoke
        self.trust.rewind_request = self._rewind
        self.membership.recover()
        self.gc_policy = GcPolicy(time.monotonic, ctx.metrics.gc_full.observe,
                                  young_threshold=SCHEDULER_YOUNG_THRESHOLD)
        """The process's garbage collection, paced by the running loop (`run`)."""
        self.jobs = Jobs(ctx)
        """The RL jobs: admission per job, drain and delete, the fleet's division between them."""
        self.jobs.moves = JobMoves(ctx, self.jobs, self.flips)
        self.jobs.planner = JobPlanner(ctx, self.rates, self.cell_summaries, self.flips, self.staleness, self.versions)
        self.flips.job_floor = JobFloor(ctx, self.jobs, self.flips).short  # each job's own min_rollout_cells
        self.membership.job_assigned = self.jobs.forget_members
        self.loop = Reconciler(ctx, self.rates, Concerns(self.membership, self.versions, self.migrations,
                                                         self.flips, self.ownership, self.scoring, self.jobs),
                               self.tally)
        """Whether the inventory is rebuilt; the last tick."""

    # ------------------------------------------------------------------ plumbing
    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def cfg(self) -> SchedulerConfig:
        return self.ctx.cfg

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    @property
    def ready(self) -> bool:
        """The inventory is rebuilt (every known cell re-synced, or the grace ran out)."""
        return self.loop.ready

    def txn(self, durable: bool = True) -> AbstractContextManager[Effects]:
        """A store transaction whose Effects run after it commits (nested calls join it)."""
        return self.ctx.txn(durable)

    def close(self) -> None:
        """Release every long-poll and client stream so shutdown does not wait on them (effects
        that wait for the disk run first, once it has synced)."""
        self.ctx.tail.close()
        self.ctx.close()

    def snapshot(self) -> Snapshot:
        """The planner's `Snapshot` (scheduler/control/snapshot.py), every field filled from what this
        scheduler measures."""
        return build_snapshot(self.ctx, self.rates, self.cell_summaries, pinned=self.flips.pinned_training,
                              version=self.versions.current(), finished_waiting=self.staleness.finished_waiting())

    def placement(self) -> Placement:
        """The planner's placement index this controller keeps over the fleet's cells, as of the
        last `snapshot()` (which brings it up to date): passed to the planner's calls, whose
        placements use up room in it (O(log cells) each), the snapshot left as it was."""
        return self.cell_summaries.placement

    # ------------------------------------------------------------------ loop
    def tick(self, defer_sync: bool = False) -> None:
        """One control-loop iteration (synchronous: runs on the event loop's thread).
        `defer_sync`: what the running loop does — the tick's durable commits do not wait for
        the disk; a worker thread syncs the WAL after the tick and their effects run once it
        has (scheduler/control/durability.py; `ctx.tail.settle()` waits for it)."""
        if not defer_sync:
            self.loop.tick()
            return
        try:
            with self.ctx.tail.deferred():
                self.loop.tick()
        finally:
            self.ctx.tail.sync_soon()

    async def run(self, interval_s: float, manage_gc: bool = False) -> None:
        """The control loop, until `close()`: it ends by itself then, since a cancel that lands
        while the wait it interrupts is also being woken can be lost. `manage_gc`: step the GC
        policy after each tick (a scheduler that owns its process)."""
        while not self.ctx.closing:
            t0 = time.perf_counter()
            try:
                self.tick(defer_sync=True)
            except Exception:  # the loop's boundary: log the reason and keep going
                log.exception("control loop tick failed")
            if manage_gc:
                self.gc_policy.step()
            end = time.perf_counter()
            # a slow tick (a large fleet) is followed by as long a rest even when kicked, so
            # the loop holds at most half the event loop and requests are served between ticks
            rest = min(end - t0, MAX_REST_S) if end - t0 > SLOW_TICK_S else 0.0
            await self.ctx.notifier.wait(TICK_KEY, interval_s)
            # kicks that come faster than MIN_TICK_GAP_S share one tick (it is level-triggered:
            # one tick carries out every flip requested since the last)
            rest = max(rest, MIN_TICK_GAP_S - (end - t0))
            left = rest - (time.perf_counter() - end)
            if left > 0 and not self.ctx.closing:  # kicks do not end the rest; `close()` does
                await self.ctx.notifier.wait(REST_KEY, left)

    # ------------------------------------------------------------------ thin API: cells
    def register(self, msg: RegisterRequest, admin: bool = False) -> RegisterResponse:
        return self.membership.register(msg, admin)

    def readmit_cell(self, cell_id: str) -> dict[str, Any]:
        return self.trust.readmit(cell_id)

    async def sync(self, cell_id: str, msg: SyncRequest) -> SyncResponse:
        return await self.membership.sync(cell_id, msg)

    def cell_view(self, cell_id: str | None = None) -> list[dict]:
        return self.membership.view(cell_id)

    def cell_page(self, after: str | None, limit: int) -> tuple[list[dict], str | None]:
        return self.membership.page(after, limit)

    def commit_migration(self, migration_id: str, body: CommitRequest) -> CommitResponse:
        """The destination's compare-and-set; the new owner's progress clock starts at it."""
        answer, moved = self.migrations.commit(migration_id, body)
        if moved is not None:
            self.ownership.advanced(moved)
        return answer

    def abort_migration(self, migration_id: str, body: AbortMigrationRequest) -> dict:
        return self.migrations.abort_by_cell(migration_id, body)

    def check_integrity(self) -> list[str]:
        """Violated ownership invariants (empty when all hold)."""
        return self.ownership.integrity_problems()

    # ------------------------------------------------------------------ thin API: operators, trainer
    def create_flips(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
                     idempotency_key: str | None = None, job: str | None = None) -> dict:
        """`job`: a job-bound trainer's flips take its own job's cells only."""
        return self.flips.request(to, cell, count, expected_generation, idempotency_key, self.jobs.foreign_cells(cell, job))

    def get_flip(self, flip_id: str) -> dict:
        return self.flips.get(flip_id)

    def publish_version(self, version: int, source: dict | None = None, idempotency_key: str | None = None,
                        job: str = "default") -> dict:
        return self.versions.publish(version, source, idempotency_key, job)

    def register_version_host(self, host: str, port: int, job: str = "default") -> dict:
        return self.versions.register_host(host, port, job)

    def retire_version(self, version: int) -> dict:
        return self.versions.retire(version)

    def export_version(self, version: int, path: str, dtype: str = "float32") -> dict:
        return self.exports.start(version, path, dtype)

    def export_view(self, export_id: str) -> dict:
        return self.exports.get(export_id)

    def versions_view(self) -> dict[str, Any]:
        """GET /v1/versions: every version, the scoring totals and the staleness rules."""
        return {"versions": self.versions.list_all(), "scoring": self.scoring.to_api(),
                "staleness": self.staleness.to_api()}

    def trajectories(self, cursor: int, limit: int, job: str | None = None) -> dict[str, Any]:
        return self.staleness.hand_out(cursor, limit, job)

    def report_training(self, batch_size: int, steps_in_progress: int, max_cells_per_step: int,
                        max_concurrent_steps: int = 1, step_s: float | None = None,
                        sessions: int | None = None, tokens: int | None = None,
                        cells: int | None = None, *, untrained: int = 0, job: str | None = None) -> dict:
        """The trainer's demand and its last step (POST /v1/trainer/report): the planner's
        training side and the staleness admission rule's fetched-but-untrained work, of `job`
        (a job-bound trainer's; None or `default`: the fleet's). Wakes the loop."""
        r = self.rates.trainer(job)
        r.on_trainer_report(
            TrainerDemand(batch_size, steps_in_progress, max_cells_per_step, max_concurrent_steps, untrained),
            step_s, sessions, tokens, cells)
        if step_s is not None:
            self.metrics.training_step.observe(step_s)
            self.metrics.training_cells.set(cells or 0)
        self.ctx.kick()
        return {"train_rate_per_cell_s": r.train_rate_per_cell_s, "train_step_s": r.train_step_s,
                "tokens_per_step": r.tokens_per_step, "auto_flip": self.cfg.auto_flip}

    # ------------------------------------------------------------------ thin API: sessions
    def submit_completion(self, session_id: str | None, prompt_ids: list[int], params: SamplingParams,
                          idempotency_key: str | None = None, agent: str | None = None,
                          request_id: str | None = None) -> RequestRow:
        return self.completions.submit(session_id, prompt_ids, params, idempotency_key, agent, request_id)

    def follow_request(self, request_id: str, live: bool = True) -> AsyncIterator[tuple[int, StoredTokens, RequestRow]]:
        return self.completions.follow(request_id, live)

    def _rewind(self, fx: Effects, req: RequestRow, first: int, reason: str) -> int | None:
        """Trust's take-back of a live request's tokens from buffer index `first` on: when no
        client was shown them, they are removed and sampled again elsewhere (returns how many);
        else None (the caller keeps the session from training; a request still live goes on
        as it is)."""
        if not self.completions.unshown_from(req, first):
            return None
        n = self.ownership.rewind(fx, req, first - req.base, reason)
        if n is not None:
            self.completions.rewound(req, first - req.base)
        return n

    def finish_session(self, session_id: str, reward: float, group_id: str | None) -> dict:
        if self.store.owners.active_request_for_session(session_id) is not None:
            raise Conflict(f"session {session_id!r} has a request in flight", code="session_busy")
        before = self.store.sessions.get(session_id)
        row = self.store.sessions.finish(session_id, reward, group_id)
        if before is None or before.state != "finished":  # a replay finished nothing new
            self.rates.on_finish()
            if self.rates.by_job:  # a fleet shared by several jobs: the session's job's own rates too
                self.rates.job(self.jobs.session_job(session_id)).on_finish()
        return {"id": row.id, "state": row.state, "reward": row.reward, "group_id": row.group_id, "cursor": row.finish_seq}

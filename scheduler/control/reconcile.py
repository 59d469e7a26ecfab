"""The control loop's two halves (Ray-style reconciler).

`sync_from` is passive: it reflects what was observed (expired leases fence their cells,
versions that every rollout cell serves become active, the fleet's tally and the store-wide
gauges follow the store). `step_next`
is active: it acts on the difference between the store and the cells (time out migrations,
advance flips, restate a role a cell lost track of, re-place requests their owner lost, drop
strays, place waiting requests, catch cells up on the version, hand out scoring, let the
planner flip). `step_next` runs only once the inventory is rebuilt after a start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.control import idempotency

if TYPE_CHECKING:
    from scheduler.control.cellsync import Membership
    from scheduler.control.context import Context
    from scheduler.control.flips import Flips
    from scheduler.control.jobs import Jobs
    from scheduler.control.migrations import Migrations
    from scheduler.control.ownership import Ownership
    from scheduler.control.rates import Rates
    from scheduler.control.scoring import Scoring
    from scheduler.control.tally import FleetTally
    from scheduler.control.versions import Versions

SLOW_GAUGES_EVERY_S = 2.0
"""Store-wide gauges (log-prob backlog per version) are recomputed at most this often."""


@dataclass
class Concerns:
    """What one tick visits, in this order."""

    membership: Membership
    versions: Versions
    migrations: Migrations
    flips: Flips
    ownership: Ownership
    scoring: Scoring
    jobs: Jobs | None = None


class Reconciler:
    """Owns the loop's own clock: `ready` (the inventory is rebuilt), the last tick and the
    last slow-gauge refresh."""

    def __init__(self, ctx: Context, rates: Rates, concerns: Concerns, tally: FleetTally) -> None:
        self.ctx = ctx
        self.rates = rates
        self.c = concerns
        self.ready = not ctx.registry.live
        """The inventory is rebuilt (every known cell re-synced, or the grace ran out)."""
        self.last_tick = ctx.started_at
        self.last_slow_tick = float("-inf")
        self.tally = tally
        ctx.metrics.fleet = tally.families

    def tick(self) -> None:
        self.sync_from()
        if self.ready:
            self.step_next()

    def sync_from(self) -> None:
        ctx = self.ctx
        now = ctx.clock()
        self.rates.on_tick(now - self.last_tick, self.tally.occupied, self.tally.offered)  # over the last tick
        self.last_tick = now
        for cell_id in ctx.registry.expired():
            self.c.membership.fence(cell_id, "lease expired")
        self.tally.advance(now)
        if not self.ready:
            self.ready = (all(e.seen for e in ctx.registry.live.values())
                          or now - ctx.started_at > ctx.cfg.lease_s)
        self.c.versions.progress()
        self.c.versions.auto_retire()
        if now - self.last_slow_tick >= SLOW_GAUGES_EVERY_S:
            self.last_slow_tick = now
            self._refresh_slow_gauges()

    def step_next(self) -> None:
        c = self.c
        c.migrations.expire()
        c.flips.step()
        c.flips.align_roles()
        c.ownership.reconcile_reports()
        c.ownership.place_waiting()
        c.versions.catch_up()
        c.scoring.step()
        per_job = c.jobs.step() if c.jobs is not None else False  # a shared fleet: each job's own flips
        if not per_job and self.ctx.cfg.auto_flip and self.rates.demand is not None:  # the trainer declared its demand
            c.flips.autonomous()

    def _refresh_slow_gauges(self) -> None:
        ctx, m = self.ctx, self.ctx.metrics
        idempotency.expire(ctx.store, ctx.cfg.idempotency_ttl_s)
        rows = ctx.store.fleet.list_versions()
        m.versions_live.set(sum(1 for r in rows if r.state != "retired"))
        backlog = ctx.store.sessions.unscored_by_version()
        for r in rows:
            m.logprob_backlog.labels(str(r.v)).set(backlog.get(r.v, 0))

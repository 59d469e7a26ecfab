"""The control loop's two halves (Ray-style reconciler).

`sync_from` is passive: it reflects what was observed (expired leases fence their cells,
versions that every rollout cell serves become active, gauges follow the store). `step_next`
is active: it acts on the difference between the store and the cells (time out migrations,
advance flips, restate a role a cell lost track of, re-place requests their owner lost, drop
strays, place waiting requests, catch cells up on the version, hand out scoring, let the
planner flip). `step_next` runs only once the inventory is rebuilt after a start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.control import idempotency
from scheduler.control.metrics import CELL_STATES

if TYPE_CHECKING:
    from scheduler.control.cellsync import Membership
    from scheduler.control.context import Context
    from scheduler.control.flips import Flips
    from scheduler.control.migrations import Migrations
    from scheduler.control.ownership import Ownership
    from scheduler.control.rates import Rates
    from scheduler.control.scoring import Scoring
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


class Reconciler:
    """Owns the loop's own clock: `ready` (the inventory is rebuilt), the last tick and the
    last slow-gauge refresh."""

    def __init__(self, ctx: Context, rates: Rates, concerns: Concerns) -> None:
        self.ctx = ctx
        self.rates = rates
        self.c = concerns
        self.ready = not ctx.registry.live
        """The inventory is rebuilt (every known cell re-synced, or the grace ran out)."""
        self.last_tick = ctx.started_at
        self.last_slow_tick = float("-inf")
        self.per_cell = PerCellGauges()

    def tick(self) -> None:
        self.sync_from()
        if self.ready:
            self.step_next()

    def sync_from(self) -> None:
        ctx = self.ctx
        now = ctx.clock()
        self._account_role_seconds(now - self.last_tick)
        self._measure_slots(now - self.last_tick)
        self.last_tick = now
        for cell_id in ctx.registry.expired():
            self.c.membership.fence(cell_id, "lease expired")
        if not self.ready:
            self.ready = (all(e.seen for e in ctx.registry.live.values())
                          or now - ctx.started_at > ctx.cfg.lease_s)
        self.c.versions.progress()
        self.c.versions.auto_retire()
        self._refresh_gauges()
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
        if self.ctx.cfg.auto_flip and self.rates.demand is not None:  # the trainer declared its demand
            c.flips.autonomous()

    def _account_role_seconds(self, dt: float) -> None:
        if dt <= 0:
            return
        m = self.ctx.metrics
        for c in self.ctx.store.fleet.list_cells():
            if c.id in self.ctx.registry.live:
                self.per_cell.child(m.role_seconds, c.id, c.state).inc(dt)

    def _measure_slots(self, dt: float) -> None:
        """Fold the tick's occupied and offered rollout slot-seconds into the measured rates
        (the finish rate is per occupied slot; occupancy is the share of slots a session holds)."""
        if dt <= 0:
            return
        owned = self.ctx.store.owners.live_counts()
        occupied = offered = 0
        for c in self.ctx.store.fleet.list_cells():
            if c.state == "rollout" and c.id in self.ctx.registry.live:
                offered += c.max_running
                occupied += min(c.max_running, owned.get(c.id, 0))
        self.rates.on_tick(dt, occupied, offered)

    def _refresh_gauges(self) -> None:
        ctx, m = self.ctx, self.ctx.metrics
        cells = ctx.store.fleet.list_cells()
        by_state: dict[str, int] = {}
        by_role = {"rollout": 0, "training": 0}
        for c in cells:
            by_state[c.state] = by_state.get(c.state, 0) + 1
            if c.state in ("rollout", "draining"):
                by_role["rollout"] += 1
            elif c.state in ("training", "loading"):
                by_role["training"] += 1
        for state in CELL_STATES:
            m.cells.labels(state).set(by_state.get(state, 0))
        for role, n in by_role.items():
            m.cells_by_role.labels(role).set(n)
        owned = ctx.store.owners.live_counts()
        for c in cells:
            summary = ctx.registry.summary(c.id)
            self.per_cell.set(m.inflight, c.id, owned.get(c.id, 0))
            self.per_cell.set(m.kv_blocks_used, c.id, summary.kv_blocks_used if summary else 0)
        counts = ctx.store.owners.count_requests()
        m.waiting.set(counts.get("queued", 0) + counts.get("suspended", 0) + counts.get("parked", 0))

    def _refresh_slow_gauges(self) -> None:
        ctx, m = self.ctx, self.ctx.metrics
        idempotency.expire(ctx.store, ctx.cfg.idempotency_ttl_s)
        rows = ctx.store.fleet.list_versions()
        m.versions_live.set(sum(1 for r in rows if r.state != "retired"))
        backlog = ctx.store.sessions.unscored_by_version()
        for r in rows:
            m.logprob_backlog.labels(str(r.v)).set(backlog.get(r.v, 0))


class PerCellGauges:
    """Per-cell metric children, looked up once and written only when their value changes: a
    tick at 10,000 cells would otherwise spend most of its time in prometheus_client's
    `labels()` (a lock and a tuple key per call) setting values that did not move."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._values: dict[tuple[int, tuple[str, ...]], float] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def set(self, metric: Any, cell_id: str, value: float) -> None:
        key = (id(metric), (cell_id,))
        if self._values.get(key) != value:
            self.child(metric, cell_id).set(value)
            self._values[key] = value

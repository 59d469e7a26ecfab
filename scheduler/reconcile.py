"""The control loop's two halves (Ray-style reconciler).

`sync_from` is passive: it reflects what was observed (expired leases fence their cells,
versions that every rollout cell serves become active, gauges follow the store). `step_next`
is active: it acts on the difference between the store and the cells (time out migrations,
advance flips, restate a role a cell lost track of, re-place requests their owner lost, drop
strays, place waiting requests).
`step_next` runs only once the inventory is rebuilt after a start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler import cellsync, flips, idempotency, migrations, ownership, scoring, versions

if TYPE_CHECKING:
    from scheduler.controller import Controller

SLOW_GAUGES_EVERY_S = 2.0
"""Store-wide gauges (log-prob backlog per version) are recomputed at most this often."""


def sync_from(ctl: Controller) -> None:
    now = ctl.clock()
    _account_role_seconds(ctl, now - ctl.last_tick)
    _measure_slots(ctl, now - ctl.last_tick)
    ctl.last_tick = now
    for cell_id in ctl.registry.expired():
        cellsync.fence(ctl, cell_id, "lease expired")
    if not ctl.ready:
        known = [e for e in ctl.registry.live.values()]
        ctl.ready = all(e.seen for e in known) or now - ctl.started_at > ctl.cfg.lease_s
    versions.progress(ctl)
    versions.auto_retire(ctl)
    _refresh_gauges(ctl, now)


def step_next(ctl: Controller) -> None:
    migrations.expire(ctl)
    flips.step(ctl)
    flips.align_roles(ctl)
    ownership.reconcile_reports(ctl)
    ownership.place_waiting(ctl)
    versions.catch_up(ctl)
    scoring.step(ctl)
    if ctl.cfg.auto_flip and ctl.rates.demand is not None:  # the trainer declared its demand
        flips.autonomous(ctl)


def _account_role_seconds(ctl: Controller, dt: float) -> None:
    if dt <= 0:
        return
    for c in ctl.store.fleet.list_cells():
        if c.id in ctl.registry.live:
            ctl.metrics.role_seconds.labels(c.id, c.state).inc(dt)


def _measure_slots(ctl: Controller, dt: float) -> None:
    """Fold the tick's occupied and offered rollout slot-seconds into the measured rates (the
    finish rate is per occupied slot; occupancy is the share of slots a session holds)."""
    if dt <= 0:
        return
    owned = ctl.store.owners.live_counts()
    occupied = offered = 0
    for c in ctl.store.fleet.list_cells():
        if c.state == "rollout" and c.id in ctl.registry.live:
            offered += c.max_running
            occupied += min(c.max_running, owned.get(c.id, 0))
    ctl.rates.on_tick(dt, occupied, offered)


def _refresh_gauges(ctl: Controller, now: float) -> None:
    m = ctl.metrics
    cells = ctl.store.fleet.list_cells()
    by_state: dict[str, int] = {}
    by_role = {"rollout": 0, "training": 0}
    for c in cells:
        by_state[c.state] = by_state.get(c.state, 0) + 1
        if c.state in ("rollout", "draining"):
            by_role["rollout"] += 1
        elif c.state in ("training", "loading"):
            by_role["training"] += 1
    for state in ("joining", "rollout", "draining", "training", "loading", "down"):
        m.cells.labels(state).set(by_state.get(state, 0))
    for role, n in by_role.items():
        m.cells_by_role.labels(role).set(n)
    owned = ctl.store.owners.live_counts()
    for c in cells:
        entry = ctl.registry.live.get(c.id)
        m.inflight.labels(c.id).set(owned.get(c.id, 0))
        m.kv_blocks_used.labels(c.id).set(entry.summary.kv_blocks_used if entry and entry.summary else 0)
    counts = ctl.store.owners.count_requests()
    m.waiting.set(counts.get("queued", 0) + counts.get("suspended", 0) + counts.get("parked", 0))
    if now - ctl.last_slow_tick < SLOW_GAUGES_EVERY_S:
        return
    ctl.last_slow_tick = now
    idempotency.expire(ctl)
    rows = ctl.store.fleet.list_versions()
    m.versions_live.set(sum(1 for r in rows if r.state != "retired"))
    backlog = ctl.store.sessions.unscored_by_version()
    for r in rows:
        m.logprob_backlog.labels(str(r.v)).set(backlog.get(r.v, 0))

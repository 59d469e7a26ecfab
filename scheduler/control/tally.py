"""What the control loop counts over the whole fleet, kept by change instead of by scan.

Each tick used to walk every cell three times (role-seconds, rollout slots, per-cell gauges):
at 10,000 cells that held the event loop ~100 ms every 200 ms, and every REST request waited
behind it. Here a tick re-reads only the cells the store's triggers (`Store.changes`) or the
registry (`Registry.watch`) named since the last one (all of them after a rolled-back
transaction), and keeps:

- the rollout slots offered and occupied (the finish rate's denominator, `Rates.on_tick`);
- the live cells in state rollout (the floor a flip to training keeps);
- each cell's seconds in each state while live, as closed intervals plus the open one.

The per-cell Prometheus families (state counts, in-flight, KV blocks, role-seconds) are built
at scrape time by `families` from the store's kept counters and the registry: O(cells) once a
scrape, not once a tick. Reads only; the caller owns the clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from scheduler.contract.states import role_of
from scheduler.control.looks import CellLooks
from scheduler.control.metrics import CELL_STATES, fleet_family

if TYPE_CHECKING:
    from scheduler.control.context import Context


@dataclass(slots=True)
class _Cell:
    state: str | None
    """None: not in the store, or down (not counted)."""
    live: bool
    max_running: int
    owned: int
    """Live (running or migrating) requests it owns."""

    def slots(self) -> tuple[int, int]:
        """(offered, occupied) rollout slots."""
        if self.state != "rollout" or not self.live:
            return 0, 0
        return self.max_running, min(self.max_running, self.owned)


class FleetTally:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.looks = CellLooks(ctx)
        self.cells: dict[str, _Cell] = {}
        self.offered = self.occupied = 0
        self.rollout: set[str] = set()
        """Live cells in state rollout."""
        self.open: dict[str, tuple[str, float]] = {}
        """cell → (state, since) while the cell is live and in a state."""
        self.closed: dict[tuple[str, str], float] = {}
        """(cell, state) → seconds of closed intervals."""

    def advance(self, now: float) -> None:
        """Re-read the cells named since the last call; intervals that end, end at `now`."""
        touched = self.looks.take()
        if touched is not None and not touched:
            return
        # of the cells looked at, those with no row (not in the store, or down): what the loop leaves
        gone = set(self.cells) if touched is None else set(touched)
        live = self.ctx.registry.live
        cells = self.cells
        for r in self.ctx.store.fleet.planning_rows(touched):
            cid = r.cell_id
            gone.discard(cid)
            old, is_live = cells.get(cid), cid in live
            if (old is not None and old.state == r.state and old.live == is_live
                    and old.max_running == r.max_running and old.owned == r.live):
                continue  # a sync that moved only what the tally does not count (KV blocks, tokens)
            self._set(cid, old, _Cell(r.state, is_live, r.max_running, r.live), now)
        for cid in gone:
            self._set(cid, cells.get(cid), None, now)

    def _set(self, cid: str, old: _Cell | None, new: _Cell | None, now: float) -> None:
        """The cell is now `new` (None: no row), was `old`."""
        if old is not None:
            o, c = old.slots()
            self.offered, self.occupied = self.offered - o, self.occupied - c
        if new is None:
            self.cells.pop(cid, None)
            new = _Cell(None, False, 0, 0)
        else:
            self.cells[cid] = new
        o, c = new.slots()
        self.offered, self.occupied = self.offered + o, self.occupied + c
        if new.live and new.state == "rollout":
            self.rollout.add(cid)
        else:
            self.rollout.discard(cid)
        self._clock(cid, new.state if new.live else None, now)

    def _clock(self, cid: str, state: str | None, now: float) -> None:
        was = self.open.get(cid)
        if was is not None and was[0] == state:
            return
        if was is not None:
            key = (cid, was[0])
            self.closed[key] = self.closed.get(key, 0.0) + max(0.0, now - was[1])
            del self.open[cid]
        if state is not None:
            self.open[cid] = (state, now)

    def role_seconds(self, now: float) -> dict[tuple[str, str], float]:
        """(cell, state) → seconds live in that state, the open intervals up to `now`."""
        out = dict(self.closed)
        for cid, (state, since) in self.open.items():
            out[(cid, state)] = out.get((cid, state), 0.0) + max(0.0, now - since)
        return out

    def families(self) -> Iterator[Metric]:
        """The fleet's per-cell and by-state families, from the store and registry now."""
        ctx = self.ctx
        self.advance(ctx.clock())
        states = ctx.store.fleet.cell_states()
        by_state = dict.fromkeys(CELL_STATES, 0)
        by_role = {"rollout": 0, "training": 0}
        for s in states.values():
            by_state[s] = by_state.get(s, 0) + 1
            role = role_of(s)
            if role is not None:
                by_role[role] += 1
        g = fleet_family("cells")
        for s, n in by_state.items():
            g.add_metric([s], n)
        yield g
        g = fleet_family("cells_by_role")
        for role, n in by_role.items():
            g.add_metric([role], n)
        yield g
        c = fleet_family("cell_role_seconds")
        for (cid, s), v in sorted(self.role_seconds(ctx.clock()).items()):
            c.add_metric([cid, s], v)
        yield c
        owned = ctx.store.owners.live_counts()
        inflight, kv = fleet_family("inflight_requests"), fleet_family("kv_blocks_used")
        for cid in sorted(states):
            inflight.add_metric([cid], owned.get(cid, 0))
            summary = ctx.registry.summary(cid)
            kv.add_metric([cid], summary.kv_blocks_used if summary else 0)
        yield inflight
        yield kv
        counts = ctx.store.owners.count_requests()
        g = fleet_family("waiting_requests")
        g.add_metric([], counts.get("queued", 0) + counts.get("suspended", 0) + counts.get("parked", 0))
        yield g

"""The planner's `Snapshot` of the control plane, built from what this scheduler measures.

Per-cell load comes from the store's kept counters (one row per cell, read with the cells in
one query: store/counters.py), rates from `Rates`, the trainer's demand as it last reported
it. Seen, live cells only. Reads only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.control.looks import CellLooks
from scheduler.control.trust import trusted
from scheduler.planner.room import Placement
from scheduler.planner.types import CellSummary, Snapshot

if TYPE_CHECKING:
    from scheduler.contract.protocol import Summary
    from scheduler.control.context import Context
    from scheduler.control.rates import Rates, TrainerDemand
    from scheduler.store.fleet import PlanningRow

UNKNOWN_VERSION = -1
"""Stands for "no version yet" in the planner's integer version fields."""

LOAD_REFRESH_PER_BUILD = 2000
"""Summaries a build rebuilds at most for a change of load or version alone (KV blocks, tokens,
the version served); the others keep their last summary and wait their turn, oldest first. A
publish's tick (every rollout cell reports the new version at once) rebuilt ~9,000 summaries
and their placement entries (~60 ms of one tick): now a few ticks share them. A change of
role, presence, trust, requests in flight, generation or capacity is always taken at once."""


class CellSummaries:
    """The per-cell part of the snapshot, kept between builds: a build re-reads only the cells
    the store's triggers (`Store.changes`) or the registry (`Registry.watch`) named since the
    last one, and everything after a rolled-back transaction."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.by_id: dict[str, CellSummary] = {}
        self.listed: list[CellSummary] = []
        """`by_id`'s values in id order."""
        self.index: dict[str, int] = {}
        """id → its place in `listed`."""
        self.training: set[str] = set()
        """Ids of `by_id` in role training."""
        self.busy_copies: dict[str, tuple[CellSummary, CellSummary]] = {}
        """id → (summary, its busy copy), reused while the summary stands."""
        self.placement = Placement(())
        """The planner's placement index over `listed`, kept up to date with it by each build
        (`current`): the controller owns it and passes it to the planner calls that use up
        room (`Controller.placement`); no `Snapshot` carries it."""
        self.looks = CellLooks(ctx)
        self.per_build = LOAD_REFRESH_PER_BUILD
        self.later: dict[str, None] = {}
        """Cells whose load or version alone changed past a build's `per_build`, oldest first:
        their summaries stand until a later build takes them."""
        self.nodes: dict[str, str] = {}
        """A cell's address → its node (the host part), worked out once per address."""
        self.caps: dict[int, tuple[dict, int, bool, str | None]] = {}
        """id of a shared decoded capabilities dict → (it, block size, KV export, KV store): what
        a summary takes from it, worked out once per dict rather than once per cell and build."""

    def current(self, demand: TrainerDemand | None, pinned: set[str]) -> tuple[CellSummary, ...]:
        """Every seen, live, not-down cell's summary, in id order. A running step keeps up to its
        width of training cells busy (those longest in training are the ones it started on; the
        store keeps no finer record, so: in id order); a pinned training cell is busy too."""
        self._refresh()
        steps = demand.steps_in_progress if demand else 0
        width = demand.max_cells_per_step if demand else 0
        training = sorted(self.training)
        busy = set(training[: steps * width if width else (len(training) if steps else 0)])
        busy.update(pinned & self.training)
        if not busy:
            return tuple(self.listed)
        out, index = list(self.listed), self.index
        for k in busy:
            out[index[k]] = self._busy_copy(k)
        return tuple(out)

    def _busy_copy(self, cid: str) -> CellSummary:
        c = self.by_id[cid]
        kept = self.busy_copies.get(cid)
        if kept is None or kept[0] is not c:
            kept = self.busy_copies[cid] = (c, _busy(c))
        return kept[1]

    def _refresh(self) -> None:
        touched = self.looks.take()
        if touched is None:
            self.by_id, self.training, self.busy_copies, self.later = {}, set(), {}, {}
        elif not touched and not self.later:
            return
        if len(self.caps) > 4096:  # decoded capabilities of cells that changed or left
            self.caps.clear()
        if len(self.nodes) > 65536:  # addresses of cells that changed or left
            self.nodes.clear()
        changed, moved = self._read(touched)
        if moved:  # cells came or went: one that was listed is not now, or one that is was not
            by_id = self.by_id
            self.listed = [by_id[k] for k in sorted(by_id)]
            self.index = {c.cell_id: i for i, c in enumerate(self.listed)}
            self.busy_copies = {k: v for k, v in self.busy_copies.items() if k in by_id}
            self.placement = Placement(self.listed).warm()
        else:
            listed = self.listed
            for i, c in changed:
                listed[i] = c
            self.placement.update(changed)

    def _read(self, touched: set[str] | None) -> tuple[list[tuple[int, CellSummary]], bool]:
        """Re-read the cells `touched` (None: all) and those waiting in `later` into `by_id` and
        `training`; returns the summaries of listed cells that stay listed, by their place, and
        whether a cell came or went (then the list is rebuilt, and the first part is not filled).
        Past `per_build` load-only changes, a cell's summary stands and it waits in `later`."""
        ctx = self.ctx
        by_id, training, index, later = self.by_id, self.training, self.index, self.later
        live = ctx.registry.live
        unprobed_ok = ctx.cfg.trust_unprobed_cells
        caps, nodes = self.caps, self.nodes
        ids = None if touched is None else [*later, *(c for c in touched if c not in later)]
        rows = ctx.store.fleet.planning_rows(ids)
        changed: list[tuple[int, CellSummary]] = []
        moved, budget = touched is None, self.per_build
        for row in rows:
            cid, entry = row.cell_id, live.get(row.cell_id)
            # a cell that has not shown it runs the model gets no request (scheduler/control/trust.py)
            if entry is not None and entry.seen and (row.trust == "verified"
                                                     or trusted(row.trust, bool(row.probed), unprobed_ok)):
                old = by_id.get(cid)
                if old is not None and _load_only(old, row, nodes):
                    if budget <= 0:
                        later[cid] = None
                        continue
                    budget -= 1
                later.pop(cid, None)
                c = by_id[cid] = _summary(row, entry.summary, caps, nodes)
                if c.role == "training":
                    training.add(cid)
                elif old is not None and old.role == "training":
                    training.discard(cid)
                if old is None:
                    moved = True
                elif not moved:
                    changed.append((index[cid], c))
            elif by_id.pop(cid, None) is not None:
                training.discard(cid)
                moved = True
        if ids is not None and len(rows) != len(ids):  # some have no planning row (down, gone)
            for cid in set(ids).difference([r.cell_id for r in rows]):
                later.pop(cid, None)
                if by_id.pop(cid, None) is not None:
                    training.discard(cid)
                    moved = True
        return changed, moved


def _load_only(old: CellSummary, row: PlanningRow, nodes: dict[str, str]) -> bool:
    """Whether `row` can change `old` in its load or version alone (KV blocks, tokens, the
    version served): the same role, generation, capacity, node and requests in flight."""
    return (old.role == row.state and old.generation == row.generation and old.capacity == row.max_running
            and old.inflight == row.live + row.incoming and nodes.get(row.address) == old.node)


def build_snapshot(ctx: Context, rates: Rates, cells: CellSummaries, *, pinned: set[str],
                   version: int | None, finished_waiting: int) -> Snapshot:
    """The cluster now: `pinned` are training cells an explicit flip holds there (busy),
    `version` the current one, `finished_waiting` the trajectories not yet fetched."""
    demand = rates.demand
    steps = demand.steps_in_progress if demand else 0
    width = demand.max_cells_per_step if demand else 0
    summaries = cells.current(demand, pinned)
    return Snapshot(
        cells=summaries, finished_waiting=finished_waiting,
        batch_size=demand.batch_size if demand else 1, training_in_progress=steps > 0,
        min_rollout_cells=ctx.cfg.min_rollout_cells,
        queued_sessions=ctx.store.owners.count_waiting(),
        version=UNKNOWN_VERSION if version is None else version,
        staleness_bound=ctx.cfg.staleness_bound, steps_in_progress=steps,
        max_cells_per_step=width or max(1, len(summaries)),
        finish_rate_per_slot_s=rates.finish_rate_per_slot_s(), slot_occupancy=rates.slot_occupancy(),
        train_rate_per_cell_s=rates.train_rate_per_cell_s, train_step_s=rates.train_step_s,
        tokens_per_step=rates.tokens_per_step,
        max_concurrent_steps=demand.max_concurrent_steps if demand else 1)


def _caps(caps: dict[str, Any]) -> tuple[dict, int, bool, str | None]:
    return caps, int(caps.get("block_size") or 16), bool(caps.get("kv_export")), caps.get("kv_store") or None


def _busy(c: CellSummary) -> CellSummary:
    """`c` busy (`dataclasses.replace(c, busy=True)`, positional: ~10x cheaper)."""
    return CellSummary(c.cell_id, c.node, c.role, c.version, c.inflight, c.capacity, c.kv_blocks_free,
                       c.kv_blocks_total, c.generation, c.can_export_kv, True, c.inflight_tokens, c.kv_store)


def _summary(row: PlanningRow, s: Summary | None,
             memo: dict[int, tuple[dict, int, bool, str | None]] | None = None,
             nodes: dict[str, str] | None = None) -> CellSummary:
    """One cell's summary from its `planning_rows` row and its last reported load (`memo`: the
    capabilities worked out before, by the id of the shared dict; checked to be that dict;
    `nodes`: each address's node, worked out before)."""
    caps = row.capabilities
    known = memo.get(id(caps)) if memo is not None else None
    if known is None or known[0] is not caps:
        known = _caps(caps)
        if memo is not None:
            memo[id(caps)] = known
    _, bs, export, kv_store = known
    total = s.kv_blocks_total if s and s.kv_blocks_total else row.kv_blocks_total
    used = s.kv_blocks_used if s else row.kv_blocks_used
    version = s.version if s else row.version
    address = row.address
    node = nodes.get(address) if nodes is not None else None
    if node is None:
        node = address.rsplit(":", 1)[0]
        if nodes is not None:
            nodes[address] = node
    # positional, in the field order (a frozen dataclass's keyword call costs twice as much)
    return CellSummary(
        row.cell_id, node, row.state, UNKNOWN_VERSION if version is None else version,
        row.live + row.incoming, row.max_running,
        # in the planner's 16-token blocks; a cell without a block pool has no KV limit
        max(0, total - used) * bs // 16 if total > 0 else 1 << 40, total * bs // 16, row.generation,
        export, False, row.tokens, kv_store)

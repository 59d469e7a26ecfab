"""The planner's `Snapshot` of the control plane, built from what this scheduler measures.

Per-cell load comes from one grouped read of the live requests, rates from `Rates`, the
trainer's demand as it last reported it. Seen, live cells only. Reads only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from scheduler.planner.types import CellSummary, Snapshot

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.rates import Rates, TrainerDemand

UNKNOWN_VERSION = -1
"""Stands for "no version yet" in the planner's integer version fields."""


def build_snapshot(ctx: Context, rates: Rates, *, pinned: set[str], version: int | None,
                   finished_waiting: int) -> Snapshot:
    """The cluster now: `pinned` are training cells an explicit flip holds there (busy),
    `version` the current one, `finished_waiting` the trajectories not yet fetched."""
    demand = rates.demand
    steps = demand.steps_in_progress if demand else 0
    width = demand.max_cells_per_step if demand else 0
    cells = _busy(_cell_summaries(ctx), demand, pinned)
    return Snapshot(
        cells=cells, finished_waiting=finished_waiting,
        batch_size=demand.batch_size if demand else 1, training_in_progress=steps > 0,
        min_rollout_cells=ctx.cfg.min_rollout_cells,
        queued_sessions=ctx.store.owners.count_waiting(),
        version=UNKNOWN_VERSION if version is None else version,
        staleness_bound=ctx.cfg.staleness_bound, steps_in_progress=steps,
        max_cells_per_step=width or max(1, len(cells)),
        finish_rate_per_slot_s=rates.finish_rate_per_slot_s(), slot_occupancy=rates.slot_occupancy(),
        train_rate_per_cell_s=rates.train_rate_per_cell_s, train_step_s=rates.train_step_s,
        tokens_per_step=rates.tokens_per_step,
        max_concurrent_steps=demand.max_concurrent_steps if demand else 1)


def _cell_summaries(ctx: Context) -> list[CellSummary]:
    load = ctx.store.owners.live_load()
    incoming = ctx.store.owners.incoming_pending()
    cells = []
    for c in ctx.store.fleet.list_cells():
        entry = ctx.registry.live.get(c.id)
        if c.state == "down" or entry is None or not entry.seen:
            continue
        s = entry.summary
        n, tokens = load.get(c.id, (0, 0))
        bs = int(c.capabilities.get("block_size") or 16)
        total = s.kv_blocks_total if s and s.kv_blocks_total else c.kv_blocks_total
        used = s.kv_blocks_used if s else c.kv_blocks_used
        version = s.version if s else c.version
        cells.append(CellSummary(
            cell_id=c.id, node=c.address.rsplit(":", 1)[0], role=c.state,  # type: ignore[arg-type]
            version=UNKNOWN_VERSION if version is None else version,
            inflight=n + incoming.get(c.id, 0), capacity=c.max_running,
            # in the planner's 16-token blocks; a cell without a block pool has no KV limit
            kv_blocks_free=max(0, total - used) * bs // 16 if total > 0 else 1 << 40,
            kv_blocks_total=total * bs // 16, generation=c.generation,
            can_export_kv=bool(c.capabilities.get("kv_export")), inflight_tokens=tokens,
            kv_store=c.capabilities.get("kv_store") or None))
    return cells


def _busy(cells: list[CellSummary], demand: TrainerDemand | None, pinned: set[str]) -> tuple[CellSummary, ...]:
    """A running step keeps up to its width of training cells busy (those longest in training
    are the ones it started on; the store keeps no finer record, so: in id order); a pinned
    training cell is busy too."""
    steps = demand.steps_in_progress if demand else 0
    width = demand.max_cells_per_step if demand else 0
    training = [i for i, c in enumerate(cells) if c.role == "training"]
    busy = set(training[: steps * width if width else (len(training) if steps else 0)])
    busy.update(i for i in training if cells[i].cell_id in pinned)
    return tuple(dataclasses.replace(c, busy=True) if i in busy else c for i, c in enumerate(cells))

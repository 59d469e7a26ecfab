"""The controller's one door to the planner: snapshots in, decisions out.

`scheduler.planner` (pure functions shared with the cluster simulator) is used when it is
importable; otherwise the minimal fallback below decides. Snapshots are per-cell summaries, so
a decision never walks the sessions. Nothing here mutates anything.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

if importlib.util.find_spec("scheduler.planner") is not None:
    from scheduler import planner as _planner
    from scheduler import planner_types as _pt
else:  # the planner module is optional while it is being written
    _planner = _pt = None

UNKNOWN_VERSION = -1
"""Stands for "no version yet" in the planner's integer version fields."""
TRAINING_BATCH_SIZE = 1
"""Sessions per training step as the planner's backlog term sees it (until configured)."""


@dataclass(frozen=True, slots=True)
class CellView:
    """One cell as the planner sees it."""

    cell_id: str
    state: str
    version: int | None
    inflight: int
    """Live requests owned (DB) plus incoming migration reservations, or the reported count if higher."""
    max_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_export: bool
    block_size: int = 16
    generation: int = 0
    node: str = ""
    """Host of the cell (cells on one host share the fast link)."""
    kv_store: str | None = None
    """Shared KV store identity (see `Capabilities.kv_store`)."""

    @property
    def free_blocks(self) -> int:
        return max(0, self.kv_blocks_total - self.kv_blocks_used)

    @property
    def has_room(self) -> bool:
        return self.state == "rollout" and self.inflight < self.max_running and (
            self.kv_blocks_total <= 0 or self.free_blocks > 0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    cells: tuple[CellView, ...]
    current_version: int | None = None
    min_rollout_cells: int = 1
    finished_waiting: int = 0
    """Finished trajectories the trainer has not fetched yet."""
    queued_requests: int = 0
    """Requests waiting for a cell (queued or suspended)."""

    def cell(self, cell_id: str) -> CellView | None:
        return next((c for c in self.cells if c.cell_id == cell_id), None)


@dataclass(frozen=True, slots=True)
class RequestSummary:
    request_id: str
    num_tokens: int
    version: int | None
    session_id: str


@dataclass(frozen=True, slots=True)
class Choice:
    """A destination and the planner's path hint ("kv", "kv_store", "reprefill"; None: decide
    by capabilities)."""

    cell_id: str
    path: str | None = None


def _needed_blocks(c: CellView, num_tokens: int) -> int:
    return (num_tokens + c.block_size - 1) // c.block_size


def _fallback_destination(snapshot: Snapshot, source_cell_id: str | None, req: RequestSummary) -> str | None:
    """Free KV blocks, same version, fewest in flight: the DESIGN's destination order."""
    fits = [c for c in snapshot.cells if c.cell_id != source_cell_id and c.has_room
            and (c.kv_blocks_total <= 0 or c.free_blocks >= _needed_blocks(c, req.num_tokens))]
    if not fits:
        return None
    best = min(fits, key=lambda c: (c.version != req.version, c.inflight / max(1, c.max_running), -c.free_blocks, c.cell_id))
    return best.cell_id


def _fallback_cells_to_flip(snapshot: Snapshot, to: str, count: int) -> list[str]:
    if to == "training":
        pool = sorted((c for c in snapshot.cells if c.state == "rollout"), key=lambda c: (c.inflight, c.cell_id))
        spare = max(0, len(pool) - snapshot.min_rollout_cells)
        return [c.cell_id for c in pool[: min(count, spare)]]
    pool = sorted((c for c in snapshot.cells if c.state == "training"), key=lambda c: c.cell_id)
    return [c.cell_id for c in pool[:count]]


def _to_planner(snapshot: Snapshot):
    cells = tuple(_pt.CellSummary(
        cell_id=c.cell_id, node=c.node, role=c.state,
        version=UNKNOWN_VERSION if c.version is None else c.version, inflight=c.inflight,
        capacity=c.max_running, kv_blocks_free=c.free_blocks if c.kv_blocks_total > 0 else 1 << 40,
        kv_blocks_total=c.kv_blocks_total, generation=c.generation, can_export_kv=c.kv_export,
        kv_store=c.kv_store)
        for c in snapshot.cells)
    return _pt.Snapshot(
        cells=cells, finished_waiting=snapshot.finished_waiting, batch_size=TRAINING_BATCH_SIZE,
        training_in_progress=any(c.state == "training" for c in snapshot.cells),
        min_rollout_cells=snapshot.min_rollout_cells, queued_sessions=snapshot.queued_requests,
        version=UNKNOWN_VERSION if snapshot.current_version is None else snapshot.current_version)


def choose_destination(snapshot: Snapshot, source_cell_id: str | None, request: RequestSummary) -> Choice | None:
    """A rollout cell with room for `request` (None: nowhere). `source_cell_id` None = new request."""
    if _planner is not None:
        version = UNKNOWN_VERSION if request.version is None else request.version
        d = _planner.choose_destination(_to_planner(snapshot), source_cell_id,
                                        _pt.RequestSummary(request.request_id, request.num_tokens, version))
        return None if d.cell_id is None else Choice(str(d.cell_id), d.path)
    cell_id = _fallback_destination(snapshot, source_cell_id, request)
    return None if cell_id is None else Choice(cell_id)


def sticky_destination(snapshot: Snapshot, cell_id: str | None, request: RequestSummary) -> Choice | None:
    """The session's previous cell when it can take the request: a later turn then reuses the
    KV its earlier turns left there (sessions stay on a cell until a migration moves them)."""
    for c in snapshot.cells:
        if c.cell_id == cell_id and c.has_room and (
                c.kv_blocks_total <= 0 or c.free_blocks >= _needed_blocks(c, request.num_tokens)):
            return Choice(c.cell_id)
    return None


def choose_cells_to_flip(snapshot: Snapshot, to: str, count: int) -> list[str]:
    """Up to `count` cells to flip `to` a role, never dipping under min_rollout_cells."""
    if _planner is not None:
        return [str(c) for c in _planner.choose_cells_to_flip(_to_planner(snapshot), to, count)]
    return _fallback_cells_to_flip(snapshot, to, count)


def plan_flips(snapshot: Snapshot) -> list[tuple[str, str]]:
    """Autonomous flips as (cell_id, to); without the planner nothing flips on its own."""
    if _planner is None:
        return []
    return [(str(d.cell_id), d.to) for d in _planner.plan_flips(_to_planner(snapshot))]

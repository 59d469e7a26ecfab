"""The controller: durable store + live cell view + the control loop.

One tick:  sync_from() (passive: leases, versions, gauges)  →  step_next() (active: flips,
migrations, placement) — the second only once the inventory is rebuilt after a start.

On start the controller rebuilds from the store: every cell not `down` gets a lease of
`lease_s` (the grace) and must sync or re-register within it; until every such cell has done
so (or the grace ran out and the silent ones were fenced) nothing active happens. Then the
reconciler is level-triggered: it compares what the store says with what cells report, so an
unfinished flip simply continues (or rolls back) from where the store says it is.

Handlers call the thin methods below; the decisions live in the modules they delegate to.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from scheduler import cellsync, completions, flips, migrations, reconcile, scoring, versions
from scheduler.config import MigrationConfig, SchedulerConfig, VersionsConfig
from scheduler.metrics import Metrics
from scheduler.notify import Notifier
from scheduler.planner_types import CellSummary, Snapshot
from scheduler.protocol import Command
from scheduler.rates import Rates, TrainerDemand
from scheduler.registry import Registry
from scheduler.staleness import StalenessState
from scheduler.stallmeter import StallMeter
from scheduler.store import Store

log = logging.getLogger("cellflip.scheduler")

UNKNOWN_VERSION = -1
"""Stands for "no version yet" in the planner's integer version fields."""

TICK_KEY = ("tick",)


@dataclass
class Effects:
    """What a transaction does to the outside world, run only after it committed."""

    ctl: Controller
    _todo: list[Callable[[], object]] = field(default_factory=list)

    def send(self, cell_id: str, make: Callable[[int], Command]) -> None:
        self._todo.append(lambda: self.ctl.registry.send(cell_id, make))

    def notify(self, key: Hashable) -> None:
        self._todo.append(lambda: self.ctl.notifier.notify(key))

    def later(self, fn: Callable[[], object]) -> None:
        self._todo.append(fn)

    def run(self) -> None:
        for fn in self._todo:
            fn()
        self._todo.clear()


class Controller:
    def __init__(self, store: Store, cfg: SchedulerConfig, migration: MigrationConfig | None = None,
                 *, clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None,
                 versions: VersionsConfig | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.mig_cfg = migration or MigrationConfig()
        self.ver_cfg = versions or VersionsConfig()
        self.scoring = scoring.ScoringState()
        self.version_sent: dict[tuple[str, int], float] = {}
        """(cell, version) → when the cell was told to load the version."""
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.notifier = Notifier()
        self.registry = Registry(clock, self.notifier)
        self.started_at = clock()
        self.ready = False
        """The inventory is rebuilt (every known cell re-synced, or the grace ran out)."""
        self.progress_at: dict[str, float] = {}
        """request id → monotonic time its current owner last advanced it: was given it (start
        or commit) or committed a token. The lost and stall rules of `reconcile_reports`."""
        self.avoid_cell: dict[str, str] = {}
        """request id → the cell it stalled on: not placed there again."""
        self.drain_deadline: dict[str, float] = {}
        """flip id → monotonic drain deadline (restarts at now + drain_deadline_s after a restart)."""
        self.migration_started: dict[str, float] = {}
        self.stalls = StallMeter()
        """Client-visible stall of each live migration, from the token arrivals here."""
        self.closing = False
        """Set at shutdown: waiting client streams end (their tokens stay in the store)."""
        self.trajectory_cursor = 0
        self.staleness = StalenessState()
        """Counters of the staleness bound's admission and hand-out rules (scheduler/staleness.py)."""
        self.rates = Rates()
        self.pinned_training: set[str] = set()
        """Cells an explicit flip sent to training: the planner does not flip them back."""
        """Finish rate, slot occupancy and training speed as measured here (the planner's inputs)."""
        """Highest trajectory cursor a trainer has fetched (the rest wait for training)."""
        self.last_tick = self.started_at
        self.last_slow_tick = float("-inf")
        self._fx: Effects | None = None
        self._recover()

    # ------------------------------------------------------------------ plumbing
    def _recover(self) -> None:
        for cell in self.store.fleet.list_cells():
            if cell.state != "down":
                self.registry.admit(cell.id, self.cfg.lease_s, seen=False)
        self.ready = not self.registry.live
        now = self.clock()
        for m in self.store.owners.pending_migrations():
            self.migration_started[m.id] = now

    @contextmanager
    def txn(self, durable: bool = True) -> Iterator[Effects]:
        """A store transaction whose Effects run after it commits (nested calls join it)."""
        if self._fx is not None:
            with self.store.tx(durable):
                yield self._fx
            return
        fx = self._fx = Effects(self)
        try:
            with self.store.tx(durable):
                yield fx
        finally:
            self._fx = None
        fx.run()

    def close(self) -> None:
        """Release every long-poll and client stream so shutdown does not wait on them."""
        self.closing = True
        self.notifier.notify_all()

    def kick(self) -> None:
        """Ask the loop for a tick soon (a flip was requested, a request is waiting)."""
        self.notifier.notify(TICK_KEY)

    def snapshot(self) -> Snapshot:
        """The planner's `Snapshot`, every field filled from what this scheduler measures: per-cell
        load from one grouped read of the live requests, rates from `self.rates`, the trainer's
        demand as it last reported it. Seen, live cells only."""
        load = self.store.owners.live_load()
        incoming = self.store.owners.incoming_pending()
        rates, demand = self.rates, self.rates.demand
        steps = demand.steps_in_progress if demand else 0
        width = demand.max_cells_per_step if demand else 0
        cells = []
        training = []
        for c in self.store.fleet.list_cells():
            entry = self.registry.live.get(c.id)
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
            if c.state == "training":
                training.append(len(cells) - 1)
        # a running step keeps up to its width of training cells busy (those longest in training
        # are the ones it started on; the store keeps no finer record, so: in id order)
        busy = set(training[: steps * width if width else (len(training) if steps else 0)])
        busy.update(i for i in training if cells[i].cell_id in self.pinned_training)
        for i in busy:
            cells[i] = dataclasses.replace(cells[i], busy=True)
        current = versions.current_version(self)
        return Snapshot(
            cells=tuple(cells),
            finished_waiting=self.store.sessions.finished_after(self.trajectory_cursor),
            batch_size=demand.batch_size if demand else 1, training_in_progress=steps > 0,
            min_rollout_cells=self.cfg.min_rollout_cells,
            queued_sessions=self.store.owners.count_waiting(),
            version=UNKNOWN_VERSION if current is None else current,
            staleness_bound=self.cfg.staleness_bound, steps_in_progress=steps,
            max_cells_per_step=width or max(1, len(cells)),
            finish_rate_per_slot_s=rates.finish_rate_per_slot_s(), slot_occupancy=rates.slot_occupancy(),
            train_rate_per_cell_s=rates.train_rate_per_cell_s, train_step_s=rates.train_step_s,
            tokens_per_step=rates.tokens_per_step,
            max_concurrent_steps=demand.max_concurrent_steps if demand else 1)

    def report_training(self, batch_size: int, steps_in_progress: int, max_cells_per_step: int,
                        max_concurrent_steps: int = 1, step_s: float | None = None,
                        sessions: int | None = None, tokens: int | None = None,
                        cells: int | None = None) -> dict:
        """The trainer's demand and its last step (POST /v1/trainer/report): the planner's
        training side. Wakes the loop so the planner sees it at once."""
        self.rates.on_trainer_report(
            TrainerDemand(batch_size, steps_in_progress, max_cells_per_step, max_concurrent_steps),
            step_s, sessions, tokens, cells)
        if step_s is not None:
            self.metrics.training_step.observe(step_s)
            self.metrics.training_cells.set(cells or 0)
        self.kick()
        r = self.rates
        return {"train_rate_per_cell_s": r.train_rate_per_cell_s, "train_step_s": r.train_step_s,
                "tokens_per_step": r.tokens_per_step, "auto_flip": self.cfg.auto_flip}

    def snapshot_version(self, cell_id: str) -> int | None:
        """The weight version a cell serves, as last reported (else as registered)."""
        entry = self.registry.live.get(cell_id)
        if entry is not None and entry.summary is not None:
            return entry.summary.version
        cell = self.store.fleet.get_cell(cell_id)
        return cell.version if cell else None

    # ------------------------------------------------------------------ loop
    def tick(self) -> None:
        """One control-loop iteration (synchronous: runs on the event loop's thread)."""
        reconcile.sync_from(self)
        if self.ready:
            reconcile.step_next(self)

    async def run(self, interval_s: float) -> None:
        """The control loop, until `close()`: it ends by itself then, since a cancel that lands
        while the wait it interrupts is also being woken can be lost."""
        while not self.closing:
            try:
                self.tick()
            except Exception:  # the loop's boundary: log the reason and keep going
                log.exception("control loop tick failed")
            await self.notifier.wait(TICK_KEY, interval_s)

    # ------------------------------------------------------------------ thin API
    register = cellsync.register
    sync = cellsync.sync
    commit_migration = migrations.commit
    abort_migration = migrations.abort_by_cell
    def create_flips(self, to: str, cell: str | None, count: int | None, expected_generation: int | None,
                     idempotency_key: str | None = None) -> dict:
        """An explicit flip (POST /v1/flips): it overrides the planner, which then leaves a cell
        flipped to training there (as busy) until an explicit flip brings it back."""
        out = flips.create(self, to, cell, count, expected_generation, idempotency_key)
        for f in out.get("flips", []):
            if to == "training":
                self.pinned_training.add(f["cell"])
            else:
                self.pinned_training.discard(f["cell"])
        return out
    publish_version = versions.publish
    retire_version = versions.retire
    list_versions = versions.list_all
    submit_completion = completions.submit
    follow_request = completions.follow

    def check_integrity(self) -> list[str]:
        """Violated ownership invariants (empty when all hold)."""
        from scheduler.ownership import integrity_problems

        return integrity_problems(self)

    def get_flip(self, flip_id: str) -> dict:
        from scheduler.errors import NotFound

        row = self.store.fleet.get_flip(flip_id)
        if row is None:
            raise NotFound(f"unknown flip {flip_id!r}")
        return row.to_api()

    def cell_view(self, cell_id: str | None = None) -> list[dict]:
        owned = self.store.owners.live_counts()
        out = []
        for c in self.store.fleet.list_cells():
            if cell_id is not None and c.id != cell_id:
                continue
            d = c.to_api()
            entry = self.registry.live.get(c.id)
            d["inflight"] = owned.get(c.id, 0)
            if entry is not None and entry.summary is not None:  # live load, not the stored copy
                d["kv_blocks_used"] = entry.summary.kv_blocks_used
            d["lease_remaining_s"] = max(0.0, entry.lease_deadline - self.clock()) if entry else 0.0
            d["history"] = [list(h) for h in c.history]
            out.append(d)
        return out

    def finish_session(self, session_id: str, reward: float, group_id: str | None) -> dict:
        from scheduler.errors import Conflict

        if self.store.owners.active_request_for_session(session_id) is not None:
            raise Conflict(f"session {session_id!r} has a request in flight", code="session_busy")
        before = self.store.sessions.get(session_id)
        row = self.store.sessions.finish(session_id, reward, group_id)
        if before is None or before.state != "finished":  # a replay finished nothing new
            self.rates.on_finish()
        return {"id": row.id, "state": row.state, "reward": row.reward, "group_id": row.group_id, "cursor": row.finish_seq}


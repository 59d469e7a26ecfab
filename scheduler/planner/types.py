"""Records the planner reads and writes: frozen, slotted, JSON-able field types only.

A `Snapshot` is a tuple of per-cell summaries plus a handful of cluster counters and
measured rates, so a planner tick at 10,000 cells never walks a million sessions. The
controller builds one per tick from its store; the cluster simulator builds one from its
arrays. Nothing here performs I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.contract.states import CellState as Role

FlipTarget = Literal["training", "rollout"]
Path = Literal["kv", "kv_store", "reprefill", "suspend"]
CellId = int | str
"""Opaque, hashable cell id (the controller uses strings, the simulator ints)."""


@dataclass(slots=True, unsafe_hash=True)
class CellSummary:
    """One cell as the planner sees it (a few integers, no sessions). A value: never changed
    once built (`dataclasses.replace` makes another); not `frozen` because a frozen dataclass's
    constructor costs ~10x as much (each field set through `object.__setattr__`), and a tick at
    full churn builds one per cell of the fleet. Equal and hashed by its fields, as before."""

    cell_id: CellId
    node: str
    """Host the cell lives on; cells on one node share the fast link."""
    role: Role
    version: int
    """Weight version the cell serves (rollout) or last loaded."""
    inflight: int
    """Sessions owned by the cell right now (0 for training cells)."""
    capacity: int
    """Most sessions the cell decodes at once."""
    kv_blocks_free: int
    kv_blocks_total: int
    generation: int
    """Compare-and-set counter of the cell's record (bumped on every role change)."""
    can_export_kv: bool
    """Engine exports/imports one request's KV (embedded engine); False forces re-prefill (SGLang)."""
    busy: bool = False
    """Training cells: part of a running step (flipping it away would stall the step)."""
    inflight_tokens: int = 0
    """Context tokens of the in-flight sessions (the cost of moving them); 0 = unknown."""
    kv_store: str | None = None
    """Identity of the shared KV store the cell's engine reads and writes (SGLang HiCache with
    a storage backend); two cells with the same identity can move a request by `kv_store`."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The cluster at one controller tick."""

    cells: tuple[CellSummary, ...]
    finished_waiting: int
    """Finished trajectories not yet consumed by a training step."""
    batch_size: int
    """Sessions one training step consumes."""
    training_in_progress: bool
    min_rollout_cells: int
    """Rollout capacity that is never flipped away."""
    queued_sessions: int
    """Sessions waiting for a rollout slot (suspended ones and new ones held back by admission)."""
    version: int = 0
    """Latest published weight version."""
    staleness_bound: int = 40
    """A session more than this many versions old is dropped, not trained."""
    steps_in_progress: int = 0
    """Training steps running now (0 with training_in_progress means one)."""
    max_cells_per_step: int = 128
    """Data-parallel width past which one step gets no faster."""
    finish_rate_per_slot_s: float = 0.0
    """Measured trajectories accepted for training per occupied rollout slot-second; 0 = unknown.
    Its inverse is the mean slot time of a session, the planner's clock for horizons."""
    slot_occupancy: float = 1.0
    """Measured share of rollout slots occupied (occupied slot-seconds over slot-seconds):
    slots wait for their next session between a finish and an admission."""
    new_session_rate_per_slot_s: float = 0.0
    """Measured finish rate a slot will have on the sessions starting now: 1 / their expected
    slot time (their token rate over the tokens a finished session holds); 0 = unknown."""
    new_session_rate_trend: float = 0.0
    """Measured change of `new_session_rate_per_slot_s` a second (0 = flat or unknown)."""
    new_session_rate_period_s: float = 0.0
    new_session_rate_swing: float = 0.0
    """Measured period of `new_session_rate_per_slot_s` as a wave (seconds) and the ratio of its
    extremes (`scheduler.control.rates.Swings`); 0 = no wave measured."""
    train_rate_per_cell_s: float = 0.0
    """Measured trajectories trained per training cell-second; 0 = unknown."""
    train_step_s: float = 0.0
    """Measured duration of the last training step (seconds), as the trainer reports it; 0 = unknown."""
    tokens_per_step: int = 0
    """Tokens the last training step consumed, as the trainer reports it; 0 = unknown."""
    max_concurrent_steps: int = 1
    """Training steps the trainer runs at once (one RL job publishing one version at a time: 1)."""

    @property
    def current_version(self) -> int | None:
        """`version`, None before any version exists (the controller's convention)."""
        return None if self.version < 0 else self.version

    def cell(self, cell_id: CellId) -> CellSummary | None:
        """O(cells): for tests and tools; the controller asks its kept `Placement` (room.py)."""
        return next((c for c in self.cells if c.cell_id == cell_id), None)


@dataclass(frozen=True, slots=True)
class FlipDecision:
    cell_id: CellId
    to: FlipTarget
    reason: str


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """One in-flight request to place elsewhere."""

    request_id: str | int
    context_tokens: int
    version: int | None
    """Weight version of the request's latest token (None: none sampled yet)."""
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class Destination:
    cell_id: CellId | None
    """Where the request goes; None with path 'suspend'."""
    path: Path
    seconds: float = 0.0
    """Estimated cost of the move (copy or re-prefill time)."""


@dataclass(frozen=True, slots=True)
class LinkCostModel:
    """What a move costs. Defaults: Qwen3-30B-A3B in BF16 on H100-class nodes."""

    kv_bytes_per_token: int = 96 * 1024
    """KV cache bytes per context token."""
    intra_node_bytes_per_s: float = 450e9
    """Cell-to-cell bandwidth within a node (NVLink)."""
    inter_node_bytes_per_s: float = 50e9
    """Cell-to-cell bandwidth between nodes."""
    prefill_tokens_per_s: float = 20_000.0
    """Re-prefill rate of a destination cell."""
    store_bytes_per_s: float = 5e9
    """Read rate of a shared KV store into a destination cell (the `kv_store` path)."""
    store_hit_ratio: float = 0.9
    """Share of a moved context found in the shared store; the rest is recomputed (blocks not
    yet written back, or evicted)."""
    block_size: int = 16
    """Tokens per KV block."""
    headroom_blocks: int = 0
    """Blocks a destination reserves beyond the current length."""


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    """Thresholds of the autonomous flip policy (see `scheduler.planner.plan.plan_flips`)."""

    backlog_target_batches: float = 1.0
    """Finished batches kept waiting so that a training step never waits for data."""
    backlog_horizon_sessions: float = 4.0
    """A backlog above the target is trained off over about this many mean session slot times
    (measured: 1 / `finish_rate_per_slot_s`), at least `backlog_horizon_steps` training steps.
    The backlog is the buffer that absorbs demand moving on the scale of one session: corrected
    within half a session time (0.5), the split chased every swing of slot time and fell below
    the best static split on held-back shapes (0.985 of it on a 10 h sine, 0.982 on an 8 h
    square wave, 200 cells, 36 h); over 4 session times every shape tried from 2 h to 24 h
    periods is at or above it (`tests/test_cluster_sim_bound.py`)."""
    backlog_horizon_steps: float = 4.0
    """Lower bound of the backlog horizon in measured training steps (`train_step_s`)."""
    backlog_horizon_s: float = 3600.0
    """The backlog horizon while neither a session nor a step has been measured."""
    deadband_fraction: float = 0.02
    """Ignore a gap between wanted and current training cells below this share of the wanted
    count (at least one cell): damps flapping from noisy rate estimates."""
    max_flip_fraction_per_tick: float = 0.05
    """Most cells flipped in one tick, as a share of the flexible cells (at least one)."""
    max_moved_sessions_per_tick: int = 2048
    """Most in-flight sessions the flips of one tick may move (at least one cell's): bounds
    the burst of KV copies on the fabric and the placement work of a tick."""
    flip_into_room: bool = True
    """Flip to training no faster than free rollout slots can take the moved sessions (at
    least one cell a tick), so drains migrate rather than suspend (but see `park_moving`)."""
    follow_new_sessions: bool = False
    """Size production on the measured rate of the sessions starting now, not on the finish
    rate alone. Off by default (on unasked in a fast wave, `fast_wave_sessions`): with
    `park_moving` it lifts `sinusoidal` (2 h period, 2 h sessions) from 0.875 to 0.96 of the
    free oracle, but loses to the best static split on held-back shapes whose period is two to
    four session times (0.92 on a 4 h sine, 0.96 on an 8 h square wave, 200 cells, 36 h): see
    README, cluster simulator."""
    forecast_lead_sessions: float = 0.125
    """Production is sized on the sessions starting now, forecast this many mean session slot
    times ahead along their measured trend (15 minutes at 2 h sessions): the split moves ahead
    of a demand that swings on the scale of one session instead of a window behind it."""
    forecast_floor: float = 0.2
    """The forecast never falls below this share of the measured rate of new sessions."""
    moving_threshold: float = 0.1
    """Demand is moving while the forecast rate and the finish rate differ by more than this share."""
    park_moving: bool = False
    """While demand moves, flip to training beyond the free room: the sessions that do not fit
    are parked (suspended, resumed by re-prefill before new sessions start), which holds new
    sessions back in the dear phase and starts them in the cheap one (admission pacing)."""
    park_max_batches: float = 8.0
    """...only while fewer than this many batches of sessions are parked (parked sessions age)."""
    fast_wave_sessions: float = 1.2
    fast_wave_swing: float = 2.5
    """`follow_new_sessions` and `park_moving` also apply, unasked, while the new sessions' rate
    is measured as a wave of period at most `fast_wave_sessions` mean slot times and of extremes
    at least `fast_wave_swing` apart: demand that swings within one session, by a lot, where
    starting sessions in the cheap phase pays for parking (`sinusoidal`: 0.93 and 2.9 measured;
    the held-back shapes it lost on, 1.4-2.6 slot times or 2.0-2.2 apart; 0 disables)."""

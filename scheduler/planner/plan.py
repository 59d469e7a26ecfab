"""The planner: every flip and placement decision, as pure functions of a `Snapshot`.

    plan_flips(snapshot, policy)                     -> [FlipDecision]  autonomous policy
    choose_cells_to_flip(snapshot, to, count)        -> [cell_id]       POST /v1/flips {"count": n}

Where moved requests go is scheduler/planner/destinations.py. The controller passes its kept
`Placement` (scheduler/planner/room.py) as `placement=`, so a flip choice costs O(log cells);
without one a fresh index is built from the snapshot.

No I/O, no clocks, no randomness, no mutation of the inputs: the controller and the cluster
simulator (bench/cluster_sim.py) call exactly these, so the simulator measures the policy
that production runs.

Flip policy (one line): make rollout production match training consumption, and let the
finished backlog nudge the split.
    p = trajectories accepted per occupied rollout slot-second x slots per cell x occupancy
        (all measured, so staleness drops and slots waiting for their next session count)
    q = trajectories trained per training cell-second (measured)
    N = flexible cells (rollout side + training side), W = finished backlog, B = batch size
    p * (N - T) + (W - W_target) / horizon = q * T   =>   T = (p N + (W - W_target)/horizon) / (p + q)
The rates are measured, not configured, so the split follows a workload whose sessions get
longer while the policy learns; the backlog term corrects for estimation error and for the
start of a run, when nothing has finished yet. Guards: cells go to training only while the
trainer can use them (running steps plus ready batches), at most a share of the fleet and
a budget of moved sessions a tick, only as fast as free rollout slots can take the moved
sessions, never below `min_rollout_cells`; only idle training cells come back (those beyond
the balance, or beyond what the trainer can use now); a deadband stops flapping. The backlog
horizon is a few measured mean session slot times (at least a few measured steps): no
hour-scale constant, so minute-long sessions are balanced as well as hour-long ones, and long
enough that the backlog absorbs demand swinging on the scale of one session instead of the
split chasing each swing (flips and joins cost; a static split would win). It is
also never shorter than the time the balance's training cells take to hand their sessions to
the slots the rollout side frees: where training holds most of the fleet, a faster correction
overshoots (cells flipped with nowhere to put their sessions suspend them), runs the backlog
dry, and sends every idle cell back at the next step's end.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from scheduler.contract.states import ROLLOUT_SIDE, TRAINING_SIDE
from scheduler.planner.room import Placement, placement_for
from scheduler.planner.types import (
    CellId,
    CellSummary,
    FlipDecision,
    FlipTarget,
    PlannerPolicy,
    Snapshot,
)

DEFAULT_POLICY = PlannerPolicy()


# ---------------------------------------------------------------- flip policy

def wanted_training_cells(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> float:
    """How many cells should train right now (a float; `plan_flips` rounds with a deadband).

    Not clamped by whether the trainer could use them this instant; see `plan_flips`.
    """
    n_roll = n_train = cap_sum = inflight = 0
    for c in snapshot.cells:
        if c.role in ROLLOUT_SIDE:
            n_roll += 1
            cap_sum += c.capacity
            inflight += c.inflight
        elif c.role in TRAINING_SIDE:
            n_train += 1
    return _balance(snapshot, policy, n_roll, n_train, cap_sum, inflight)


def _balance(snapshot: Snapshot, policy: PlannerPolicy, n_roll: int, n_train: int,
             cap_sum: int, inflight: int) -> float:
    n_flex = n_roll + n_train
    if n_flex == 0:
        return 0.0
    cap = cap_sum / n_roll if n_roll else 0.0
    rate = production_rate_per_slot_s(snapshot, policy)
    # the rate is per *occupied* slot: a cell produces it on the slots it keeps occupied
    p = rate * cap * min(1.0, max(0.0, snapshot.slot_occupancy))
    q = snapshot.train_rate_per_cell_s
    backlog = snapshot.finished_waiting - policy.backlog_target_batches * snapshot.batch_size
    horizon = backlog_horizon_s(snapshot, policy, rate)
    if p > 0.0 and q > 0.0 and n_roll:
        # no faster than cells can move: the balance's training cells hand their sessions to
        # the slots the rollout side frees (a finish rate per slot a second), or they suspend
        horizon = max(horizon, p * n_flex / (p + q) / (n_roll * rate))
    surplus = backlog / horizon
    if q <= 0.0:
        # training speed not measured yet: give training what the ready batches can use
        want = float(_useful_training_cells(snapshot))
    else:
        want = (p * n_flex + surplus) / (p + q)
    # rollout cells beyond the demand (a harness with fewer sessions than slots) show up as a
    # low measured occupancy, which lowers p and so moves cells to training: no second rule
    return min(max(want, 0.0), float(max(0, n_flex - snapshot.min_rollout_cells)))


def production_rate_per_slot_s(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> float:
    """Sessions an occupied rollout slot will finish a second: the rate of the sessions starting
    now (`new_session_rate_per_slot_s`) forecast `forecast_lead_sessions` mean slot times ahead
    along its trend, at least `forecast_floor` of it; the measured finish rate while the new
    sessions' rate is unknown. A slot holds a session for its whole slot time, so what the
    sessions starting now will cost, not what the ones finishing now cost, sizes the split."""
    f = snapshot.finish_rate_per_slot_s
    new = snapshot.new_session_rate_per_slot_s
    if new <= 0.0 or f <= 0.0 or not follows_new_sessions(snapshot, policy):
        return f
    ahead = new + policy.forecast_lead_sessions / f * snapshot.new_session_rate_trend
    return max(ahead, policy.forecast_floor * new)


def fast_wave(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> bool:
    """The new sessions' rate is measured as a wave within `fast_wave_sessions` mean slot times,
    its extremes at least `fast_wave_swing` apart (`PlannerPolicy.fast_wave_sessions`)."""
    period, f = snapshot.new_session_rate_period_s, snapshot.finish_rate_per_slot_s
    return (policy.fast_wave_sessions > 0.0 and period > 0.0 and f > 0.0
            and period * f <= policy.fast_wave_sessions and snapshot.new_session_rate_swing >= policy.fast_wave_swing)


def follows_new_sessions(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> bool:
    """Production is sized on the sessions starting now: asked (`follow_new_sessions`), or a fast wave."""
    return policy.follow_new_sessions or fast_wave(snapshot, policy)


def demand_moving(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> bool:
    """The forecast production rate is off the finish rate by more than `moving_threshold`."""
    f = snapshot.finish_rate_per_slot_s
    if f <= 0.0 or snapshot.new_session_rate_per_slot_s <= 0.0:
        return False
    return abs(production_rate_per_slot_s(snapshot, policy) / f - 1.0) > policy.moving_threshold


def may_park(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY) -> bool:
    """Flips to training may go beyond the free room (`PlannerPolicy.park_moving`)."""
    parks = policy.park_moving or fast_wave(snapshot, policy)
    return (not policy.flip_into_room or parks and demand_moving(snapshot, policy)
            and snapshot.queued_sessions < policy.park_max_batches * snapshot.batch_size)


def backlog_horizon_s(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY,
                      rate: float | None = None) -> float:
    """Seconds over which a backlog off its target is corrected: a share of the mean session
    slot time (1 / `rate`, default the measured finish rate), at least a few measured training
    steps (the hour-scale constant only while neither was measured)."""
    h = 0.0
    rate = snapshot.finish_rate_per_slot_s if rate is None else rate
    if rate > 0.0:
        h = policy.backlog_horizon_sessions / rate
    if snapshot.train_step_s > 0.0:
        h = max(h, policy.backlog_horizon_steps * snapshot.train_step_s)
    return h if h > 0.0 else policy.backlog_horizon_s


def _useful_training_cells(snapshot: Snapshot) -> int:
    """Cells the trainer can keep busy: running steps plus ready batches, as many steps as it
    runs at once, each up to its width."""
    steps = snapshot.steps_in_progress or (1 if snapshot.training_in_progress else 0)
    ready = snapshot.finished_waiting // max(1, snapshot.batch_size)
    return min(steps + ready, max(1, snapshot.max_concurrent_steps)) * snapshot.max_cells_per_step


def plan_flips(snapshot: Snapshot, policy: PlannerPolicy = DEFAULT_POLICY,
               placement: Placement | None = None) -> list[FlipDecision]:
    """Flips that move the split toward the balance (module docstring). Pure.

    To training: only while the trainer could use the cells now (running steps plus ready
    batches), never below `min_rollout_cells`, cheapest-to-move cells first. To rollout:
    only idle training cells (a busy one would stall its step); they come back when the
    split says training has more cells than it needs.
    """
    n_roll = n_rollout_role = n_train = n_idle = cap_sum = inflight = room = 0
    for c in snapshot.cells:  # O(cells), ~0.2 us a cell: ~2 ms at 10,000 cells
        role = c.role
        if role == "rollout":
            n_rollout_role += 1
            cap_sum += c.capacity
            inflight += c.inflight
            room += c.capacity - c.inflight
        elif role == "training":
            n_train += 1
            if not c.busy:
                n_idle += 1
        elif role in ROLLOUT_SIDE:
            n_roll += 1
            cap_sum += c.capacity
            inflight += c.inflight
        elif role in TRAINING_SIDE:
            n_train += 1
    n_roll += n_rollout_role
    want = _balance(snapshot, policy, n_roll, n_train, cap_sum, inflight)
    deadband = max(1.0, policy.deadband_fraction * want)
    max_flips = max(1, int(policy.max_flip_fraction_per_tick * (n_roll + n_train)))
    useful = _useful_training_cells(snapshot)
    want_now = min(want, float(max(n_train, useful)))
    if want_now - n_train >= deadband:
        spare = n_rollout_role - snapshot.min_rollout_cells
        count = min(int(want_now - n_train), max_flips, spare)
        chosen = _cheapest_rollout(snapshot, count, placement=placement)
        chosen = _within_budget(snapshot.cells, chosen, math.inf if may_park(snapshot, policy) else room,
                                policy.max_moved_sessions_per_tick)
        reason = f"balance: want {want:.1f} training cells, have {n_train}"
        return [FlipDecision(snapshot.cells[i].cell_id, "training", reason) for i in chosen]
    # back to rollout: idle cells beyond the balance, or beyond what the trainer can use now
    # (no step running and no batch ready): an idle training cell decodes nothing
    want_back = min(want, float(useful))
    if n_train - want_back >= max(1.0, policy.deadband_fraction * want_back) and n_idle:
        count = min(int(n_train - want_back), max_flips, n_idle)
        reason = f"balance: want {want:.1f} training cells, have {n_train}"
        return [FlipDecision(cid, "rollout", reason)
                for cid in choose_cells_to_flip(snapshot, "rollout", count, idle_only=True)]
    return []


def choose_cells_to_flip(snapshot: Snapshot, to: FlipTarget, count: int, idle_only: bool = False,
                         exclude: AbstractSet[CellId] = frozenset(),
                         placement: Placement | None = None) -> list[CellId]:
    """Up to `count` cells to flip `to` a role, cheapest to move first. Pure.

    To training: rollout cells, fewest seconds of in-flight work to move (KV bytes over the
    slow link, or re-prefill for engines without KV export), keeping `min_rollout_cells`.
    To rollout: idle training cells first, then busy ones unless `idle_only`.
    Cells in `exclude` (a flip already under way) are neither picked nor counted in a role.
    """
    if count <= 0:
        return []
    cells = snapshot.cells
    if to == "training":
        return [cells[i].cell_id for i in _cheapest_rollout(snapshot, count, exclude, placement)]
    if to == "rollout":
        training = [(c.busy, i) for i, c in enumerate(cells) if c.role == "training"
                    and not (idle_only and c.busy) and c.cell_id not in exclude]
        return [cells[i].cell_id for _, i in heapq.nsmallest(count, training)]
    raise ValueError(f"flip target must be 'training' or 'rollout', got {to!r}")


def _cheapest_rollout(snapshot: Snapshot, count: int, exclude: AbstractSet[CellId] = frozenset(),
                      placement: Placement | None = None) -> list[int]:
    """Indices of up to `count` rollout cells not in `exclude`, cheapest to drain first,
    keeping the minimum (on the caller's kept `placement` when given, else a fresh one)."""
    return placement_for(snapshot, placement).cheapest_rollout(count, exclude, snapshot.min_rollout_cells)


def _within_budget(cells: Sequence[CellSummary], chosen: list[int], room: float,
                   max_moves: int) -> list[int]:
    """The prefix of `chosen` whose sessions fit in the free `room` of the other rollout
    cells and in `max_moves` (always at least one cell)."""
    out: list[int] = []
    moved = 0
    for i in chosen:
        c = cells[i]
        room -= c.capacity - c.inflight  # a draining cell's own free slots are no destination
        if out and (c.inflight > room or moved + c.inflight > max_moves):
            break
        room -= c.inflight
        moved += c.inflight
        out.append(i)
    return out

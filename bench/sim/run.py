"""One simulated run: a workload, a policy, N cells, H hours -> `RunResult`.

One line: advance to the tick (exact finishes and training events) -> measure rates (the
controller's `scheduler.control.rates.Rates`) ->
policy decides (flips, migrations) -> resume suspended -> admit -> record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scheduler.control.rates import Rates, TrainerDemand

from .cluster import INF, LOADING, ROLLOUT, TRAINING, Cluster
from .policies import Planned, Policy, Replayed
from .trainer import Trainer
from .workload import Workload


@dataclass
class RunResult:
    policy: str
    cells: int
    hours: float
    utilization: float
    """Busy cell-time (decoding, moving or training) over cell-time."""
    goodput_utilization: float
    """(Decode time of sessions later trained + training time) over cell-time."""
    trained_tokens_per_hour: float
    """Tokens of trained sessions (each by its own length) per hour."""
    trained_sessions: float
    """Sessions trained, counting the done share of the step still running at the horizon."""
    dropped_fraction: float
    """Decoded tokens discarded (stale, aborted, cut) over decoded tokens."""
    recomputed_tokens: int
    dropped_sessions: int
    mean_staleness: float
    staleness_hist: list[int]
    lost_work_cell_hours: float
    moves: dict[str, int]
    flips: int
    versions: int
    wall_s: float
    series: dict[str, list[float]] = field(default_factory=dict)

    def metrics(self) -> dict:
        """The figures of the bench JSON."""
        return {
            "trained_tokens_per_hour": round(self.trained_tokens_per_hour, 1),
            "utilization": round(self.utilization, 4),
            "goodput_utilization": round(self.goodput_utilization, 4),
            "dropped_fraction": round(self.dropped_fraction, 4),
            "recomputed_tokens": int(self.recomputed_tokens),
            "mean_staleness": round(self.mean_staleness, 3),
            "versions": int(self.versions),
        }

    def staleness_quantiles(self) -> dict[str, int]:
        h = np.asarray(self.staleness_hist)
        if h.sum() == 0:
            return {}
        cdf = np.cumsum(h) / h.sum()
        return {f"p{q}": int(np.searchsorted(cdf, q / 100)) for q in (50, 90, 99)} | {"max": int(np.flatnonzero(h)[-1])}


def run_policy(wl: Workload, policy: Policy, n_cells: int, hours: float | None = None, seed: int = 0,
               tick_s: float | None = None, record_s: float = 600.0, check: bool = False,
               on_tick: Callable[[Cluster, Rates, float], None] | None = None) -> RunResult:
    """Simulate `hours` (default: the workload's, else 72) of `policy` on `wl`. `check`
    verifies the state's invariants every tick; `on_tick(cluster, rates, t)` is called at the
    end of every tick (tests mirror the run into a scheduler with it)."""
    wall0 = time.perf_counter()
    hours = hours or wl.hours or 72.0
    tick_s = tick_s or wl.tick_s
    batch, width = wl.batch_for(n_cells)
    trainer = Trainer(batch, wl.train_cell_s_per_token(), n_cells if policy.is_sync else width,
                      None if policy.is_sync else wl.staleness_bound, wl.scaling_efficiency,
                      efficiency_width=width)  # sync: the whole fleet trains each round, same curve
    trainer.join_s = 0.0 if policy.mode == "free" else wl.train_join_s  # the oracle's moves are free
    cl = Cluster(wl, n_cells, hours, seed, tick_s, policy.mode, trainer)
    seen_version, streaming = 0, 0.0
    policy.start(cl)
    if policy.admits(cl, 0.0):
        cl.admit(0.0, policy.admit_limit(cl, 0.0))
    # the controller's measurements, by the controller's own code (scheduler.control.rates)
    rates = Rates()
    last_step = None
    occupied = int(cl.inflight.sum())
    offered = int((cl.role == ROLLOUT).sum()) * cl.k
    series: dict[str, list[float]] = {k: [] for k in
                                      ("t_h", "rollout_cells", "training_cells", "decoding", "training_busy",
                                       "trained_sessions", "version", "suspended")}
    record_every = max(1, round(record_s / tick_s))
    n_ticks = math.ceil(cl.horizon_s / tick_s)
    for k in range(1, n_ticks + 1):
        t = min(k * tick_s, cl.horizon_s)
        dt = t - (k - 1) * tick_s
        cl.accepted_in_tick, cl.finished_in_tick, cl.freed_slot_s_in_tick = 0, 0, 0.0
        decoded = cl.decoded_tokens
        cl.advance(t)
        if trainer.version > seen_version and not policy.is_sync:  # sync loads its weights instead
            streaming = wl.broadcast_s  # the newest version streams in (it supersedes the one streaming)
        seen_version = trainer.version
        if streaming > 0:  # decoding at broadcast_decode_ratio meanwhile
            _slow_decoding(cl, min(dt, streaming) * (1.0 - wl.broadcast_decode_ratio), t)
            streaming -= dt
        cl.refresh_busy()
        finished_tokens = cl.decoded_tokens - decoded  # advance adds the finished sessions' tokens only
        rates.on_finish(cl.accepted_in_tick, finished_tokens * cl.accepted_in_tick / max(1, cl.finished_in_tick))
        rates.on_tick(dt, max(0.0, occupied * dt - cl.freed_slot_s_in_tick) / dt, max(offered, occupied))
        tokens_per_s, n_new = cl.new_sessions(t - rates.new_window_s())
        if n_new >= cl.k:  # at least a cell's worth started lately
            rates.on_new_sessions(t, tokens_per_s, n_new)
        if trainer.last_step is not last_step:  # the trainer reports each finished step
            last_step = trainer.last_step
            step_s, sessions, tokens, cells = last_step
            rates.on_trainer_report(_demand(trainer), step_s, sessions, int(tokens), max(1, round(cells)))
        else:
            rates.demand = _demand(trainer)
        policy.tick(cl, t, rates)
        cl.resume_suspended(t)
        if policy.admits(cl, t):
            cl.admit(t, policy.admit_limit(cl, t))
        cl.refresh_busy()
        occupied = int(cl.inflight.sum())
        offered = int((cl.role == ROLLOUT).sum()) * cl.k
        if check:
            cl.check_integrity()
        if on_tick is not None:
            on_tick(cl, rates, t)
        if k % record_every == 0 or k == n_ticks:
            _record(series, cl, t)
    cl.close_books()
    tr = cl.trainer
    total_cell_s = n_cells * cl.horizon_s
    busy = cl.decode_slot_s / cl.k + tr.busy_cell_s + cl.source_delay_cell_s
    decoded = cl.decoded_tokens
    return RunResult(
        policy=policy.name, cells=n_cells, hours=hours,
        utilization=float(busy / total_cell_s),
        goodput_utilization=float((tr.trained_slot_s_equivalent() / cl.k + tr.busy_cell_s) / total_cell_s),
        trained_tokens_per_hour=tr.trained_tokens_equivalent() / hours,
        trained_sessions=tr.trained_equivalent(),
        dropped_fraction=float((tr.dropped_tokens + cl.discarded_tokens) / decoded) if decoded > 0 else 0.0,
        recomputed_tokens=cl.recomputed_tokens,
        dropped_sessions=tr.dropped,
        mean_staleness=tr.mean_staleness(),
        staleness_hist=tr.staleness_hist.tolist(),
        lost_work_cell_hours=(tr.dropped_slot_s + cl.discarded_slot_s + cl.pause_slot_s) / cl.k / 3600.0,
        moves=dict(cl.moved), flips=getattr(policy, "flips", 0), versions=tr.version,
        wall_s=time.perf_counter() - wall0, series=series)


PAIRED_MODES = {"cellflip": "reprefill", "flip_reprefill": "kv"}
"""A planned run's paired twin moves sessions the other way: live KV copy <-> re-prefill."""


def run_paired(wl: Workload, lead: str, n_cells: int, hours: float | None = None,
               seed: int = 0) -> tuple[RunResult, RunResult]:
    """`lead` ("cellflip" or "flip_reprefill") on `seed`, then its paired twin: the same seed
    (the same sessions, common random numbers) and the same flips at the same ticks
    (`Replayed`), each move the other way. Returns (lead's run, the twin's)."""
    if lead not in PAIRED_MODES:
        raise ValueError(f"a paired run leads with one of {sorted(PAIRED_MODES)}, got {lead!r}")
    first = Planned(lead, "kv" if lead == "cellflip" else "reprefill")
    own = run_policy(wl, first, n_cells, hours, seed=seed)
    twin = Replayed(f"{lead}@{PAIRED_MODES[lead]}", PAIRED_MODES[lead], first.trace, first.fresh)
    paired = run_policy(wl, twin, n_cells, hours, seed=seed)
    if twin.skipped:
        raise AssertionError(f"{twin.name}: {twin.skipped} replayed flips found their cell in another role")
    return own, paired


def _slow_decoding(cl: Cluster, seconds: float, t: float) -> None:
    """Every session decoding at `t` falls `seconds` behind (a version streaming in)."""
    live = (cl.end < INF) & (cl.occ <= t)
    cl.t0[live] += seconds
    cl.end[live] += seconds
    cl.pause_slot_s += seconds * float(live.sum())


def _demand(tr: Trainer) -> TrainerDemand:
    return TrainerDemand(tr.batch_size, len(tr.steps), tr.width, 1)

def _record(series: dict[str, list[float]], cl: Cluster, t: float) -> None:
    series["t_h"].append(t / 3600.0)
    series["rollout_cells"].append(float(((cl.role == ROLLOUT) | (cl.role == LOADING)).sum()))
    series["training_cells"].append(float((cl.role == TRAINING).sum()))
    series["decoding"].append(cl.occupied_decoding(t) / cl.k)
    series["training_busy"].append(float(cl.trainer.busy_cells()))
    series["trained_sessions"].append(cl.trainer.trained_equivalent())
    series["version"].append(float(cl.trainer.version))
    series["suspended"].append(float(len(cl.suspended)))

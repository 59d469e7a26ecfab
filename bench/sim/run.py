"""One simulated run: a workload, a policy, N cells, H hours -> `RunResult`.

One line: advance to the tick (exact finishes and training events) -> measure rates ->
policy decides (flips, migrations) -> resume suspended -> admit -> record.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .cluster import LOADING, ROLLOUT, TRAINING, Cluster
from .policies import Policy
from .trainer import Trainer
from .workload import Workload


@dataclass
class RunResult:
    policy: str
    cells: int
    hours: float
    utilization: float
    trained_tokens_per_hour: float
    trained_sessions: float
    """Sessions trained, counting the done share of steps still running at the horizon."""
    recomputed_tokens: int
    dropped_sessions: int
    mean_staleness: float
    staleness_hist: list[int]
    lost_work_cell_hours: float
    moves: dict[str, int]
    flips: int
    wall_s: float
    series: dict[str, list[float]] = field(default_factory=dict)

    def metrics(self) -> dict:
        """The five figures of the bench JSON."""
        return {
            "utilization": round(self.utilization, 4),
            "trained_tokens_per_hour": round(self.trained_tokens_per_hour, 1),
            "recomputed_tokens": int(self.recomputed_tokens),
            "dropped_sessions": int(self.dropped_sessions),
            "mean_staleness": round(self.mean_staleness, 3),
        }

    def staleness_quantiles(self) -> dict[str, int]:
        h = np.asarray(self.staleness_hist)
        if h.sum() == 0:
            return {}
        cdf = np.cumsum(h) / h.sum()
        return {f"p{q}": int(np.searchsorted(cdf, q / 100)) for q in (50, 90, 99)} | {"max": int(np.flatnonzero(h)[-1])}


def run_policy(wl: Workload, policy: Policy, n_cells: int, hours: float, seed: int = 0,
               tick_s: float = 60.0, record_s: float = 600.0, rate_window_s: float = 3600.0,
               check: bool = False) -> RunResult:
    """Simulate `hours` of `policy` on `wl`. `check` verifies the state's invariants every tick."""
    wall0 = time.perf_counter()
    trainer = Trainer(wl.batch_size, wl.step_cell_hours, wl.max_cells_per_step,
                      None if policy.sequential else wl.staleness_bound, policy.sequential)
    cl = Cluster(wl, n_cells, hours, seed, tick_s, policy.can_export_kv, trainer)
    policy.start(cl)
    if policy.admits(cl, 0.0):
        cl.admit(0.0)
    # the controller's measurements: EWMAs of accepted finishes and occupied slot-seconds
    alpha = 1.0 - math.exp(-tick_s / rate_window_s)
    num = den = 0.0
    rates = {"finish_rate_per_slot_s": 0.0,
             "train_rate_per_cell_s": wl.batch_size / (wl.step_cell_hours * 3600.0)}
    occupied = int(cl.inflight.sum())
    series: dict[str, list[float]] = {k: [] for k in
                                      ("t_h", "rollout_cells", "training_cells", "decoding", "training_busy",
                                       "trained_sessions", "version", "suspended")}
    record_every = max(1, round(record_s / tick_s))
    n_ticks = math.ceil(cl.horizon_s / tick_s)
    for k in range(1, n_ticks + 1):
        t = min(k * tick_s, cl.horizon_s)
        cl.accepted_in_tick, cl.freed_slot_s_in_tick = 0, 0.0
        cl.advance(t)
        cl.refresh_busy()
        num = (1 - alpha) * num + alpha * cl.accepted_in_tick
        den = (1 - alpha) * den + alpha * max(0.0, occupied * (t - (k - 1) * tick_s) - cl.freed_slot_s_in_tick)
        rates["finish_rate_per_slot_s"] = num / den if den > 0 else 0.0
        policy.tick(cl, t, rates)
        cl.resume_suspended(t)
        if policy.admits(cl, t):
            cl.admit(t)
        cl.refresh_busy()
        occupied = int(cl.inflight.sum())
        if check:
            cl.check_integrity()
        if k % record_every == 0 or k == n_ticks:
            _record(series, cl, t)
    cl.close_books()
    tr = cl.trainer
    total_cell_s = n_cells * cl.horizon_s
    busy = cl.decode_slot_s / cl.k + tr.busy_cell_s
    return RunResult(
        policy=policy.name, cells=n_cells, hours=hours,
        utilization=float(busy / total_cell_s),
        trained_tokens_per_hour=tr.trained_equivalent() * wl.session_tokens / hours,
        trained_sessions=tr.trained_equivalent(),
        recomputed_tokens=cl.recomputed_tokens,
        dropped_sessions=tr.dropped,
        mean_staleness=tr.mean_staleness(),
        staleness_hist=tr.staleness_hist.tolist(),
        lost_work_cell_hours=(tr.dropped_slot_s + cl.pause_slot_s) / cl.k / 3600.0,
        moves=dict(cl.moved), flips=getattr(policy, "flips", 0),
        wall_s=time.perf_counter() - wall0, series=series)


def _record(series: dict[str, list[float]], cl: Cluster, t: float) -> None:
    series["t_h"].append(t / 3600.0)
    series["rollout_cells"].append(float(((cl.role == ROLLOUT) | (cl.role == LOADING)).sum()))
    series["training_cells"].append(float((cl.role == TRAINING).sum()))
    series["decoding"].append(cl.occupied_decoding(t) / cl.k)
    series["training_busy"].append(float(cl.trainer.busy_cells()))
    series["trained_sessions"].append(cl.trainer.trained_equivalent())
    series["version"].append(float(cl.trainer.version))
    series["suspended"].append(float(len(cl.suspended)))

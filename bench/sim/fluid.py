"""The fluid bound of a workload: what free re-balancing gains over the best fixed split.

One line: slot time m(t) from the workload's own model -> a fixed split f buffers production
f N k / m(t) against training (1 - f) N / b within a staleness-sized buffer -> free
re-balancing trains N / (m(t) / k + b) every instant (or buffers as a fixed split does) ->
gain = max(free, best fixed) / best fixed - 1.

b is a mean session's training cell-seconds at the efficiency of the balanced width. The
buffer a fixed split may fill before the staleness bound drops what waits is taken as half
the bound's worth of batches (the other half is the versions a session spends decoding).
No planner, no simulator: arithmetic on the workload alone.
"""

from __future__ import annotations

import numpy as np

from .workload import Workload


def rebalance_gain(wl: Workload, cells: int, hours: float, dt_s: float = 60.0) -> float:
    batch, width = wl.batch_for(cells)
    t = np.arange(0.0, hours * 3600.0, dt_s)
    m = np.asarray(wl.mean_hours_at(t, hours * 3600.0), dtype=float) * 3600.0
    k = wl.cell_capacity
    b0 = wl.session_tokens * wl.train_cell_s_per_token()
    a_mean = float(m.mean()) / k
    c = cells * b0 / (a_mean + b0)

    def eff(x: float) -> float:
        if x <= 1 or width <= 1:
            return 1.0
        return wl.scaling_efficiency ** (np.log2(x) / np.log2(width))

    b = b0 / eff(c)
    # free: every instant at its own balance, training never wider than a step
    c_t = np.minimum(width, cells * b / (m / k + b))
    free = float(np.minimum((cells - c_t) * k / m, c_t / b).sum() * dt_s)
    buf_max = max(batch, wl.staleness_bound * batch / 2)
    best = 0.0
    for f in np.linspace(0.0, 1.0, 201):
        prod = f * cells * k / m * dt_s
        cap = min(width, (1.0 - f) * cells) / b * dt_s
        buf = trained = 0.0
        for p in prod:  # 4,320 steps at 72 h: cheap enough per f
            buf += p
            x = min(buf, cap)
            trained += x
            buf = min(buf - x, buf_max)
        best = max(best, trained)
    # free re-balancing may also buffer as a fixed split does: it gains at least nothing
    return max(0.0, free / best - 1.0) if best > 0 else 0.0

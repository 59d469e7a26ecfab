"""How many cells each RL job holds: a pure function of each job's bounds, weight, measured
demand and current holding (production's reconcile tick and the simulator call the same code).

One line: minimums first → the rest by weight up to each job's demand → what is left by weight
up to each maximum → rounded against what each job holds, with a dead band (hysteresis plus a
move's cost over the horizon) so that a job near its share keeps its cells.

(Provisional module: the planner-and-simulator side of multi-job scheduling keeps this
interface; see docs/JOBS.md.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EPS = 1e-9


@dataclass(frozen=True)
class JobShare:
    name: str
    min_cells: int
    max_cells: int
    """Most cells the job may hold (a job with no maximum: the fleet's size)."""
    weight: float
    demand_cells: float
    """Cells the job's measured demand keeps busy (rollout plus training)."""
    held: int
    """Cells the job holds now (a cell moving into it counts for it)."""


def _fill(alloc: dict[str, float], caps: Mapping[str, float], weights: Mapping[str, float], left: float) -> float:
    """Weighted water-filling: share `left` among jobs by weight, none past its cap; returns what is left."""
    active = [n for n in alloc if caps[n] - alloc[n] > EPS]
    while left > EPS and active:
        total_w = sum(weights[n] for n in active)
        given = 0.0
        for n in active:
            give = min(caps[n] - alloc[n], left * weights[n] / total_w)
            alloc[n] += give
            given += give
        left -= given
        active = [n for n in active if caps[n] - alloc[n] > EPS]
        if given <= EPS:
            break
    return left


def ideal_shares(jobs: Sequence[JobShare], total: int) -> dict[str, float]:
    """Fractional cells per job: each minimum (scaled down by weight order when the minimums
    exceed the fleet), then demand by weight, then spare capacity by weight up to each maximum."""
    alloc = {j.name: 0.0 for j in jobs}
    left = float(total)
    for j in sorted(jobs, key=lambda j: (-j.weight, j.name)):  # heavier jobs' minimums first
        give = min(float(min(j.min_cells, j.max_cells)), left)
        alloc[j.name] = give
        left -= give
    weights = {j.name: max(j.weight, EPS) for j in jobs}
    want = {j.name: max(alloc[j.name], min(float(j.max_cells), j.demand_cells)) for j in jobs}
    left = _fill(alloc, want, weights, left)
    _fill(alloc, {j.name: float(j.max_cells) for j in jobs}, weights, left)
    return alloc


def divide(jobs: Sequence[JobShare], total: int, *, hysteresis_cells: float = 1.0, move_cost_s: float = 0.0,
           horizon_s: float = 600.0) -> dict[str, int]:
    """Whole cells per job (summing to at most `total`: cells past every maximum stay unassigned).

    Starts from what each job holds, first forced into its bounds and the fleet's size, then
    moves one cell at a time from the job most over its ideal share to the one most under it,
    only while both are off by more than the dead band: `hysteresis_cells / 2` plus the move's
    cost as a fraction of the horizon (`move_cost_s / horizon_s`: the cell time a drain plus a
    weight load loses, against the time the move pays back over)."""
    if not jobs:
        return {}
    ideal = ideal_shares(jobs, total)
    by_name = {j.name: j for j in jobs}
    lo = {j.name: min(j.min_cells, j.max_cells) for j in jobs}
    alloc = {j.name: max(lo[j.name], min(j.held, j.max_cells)) for j in jobs}
    _fit_total(alloc, ideal, lo, total)
    band = hysteresis_cells / 2 + (move_cost_s / horizon_s if horizon_s > 0 else 0.0)
    for _ in range(total + 1):
        donors = [n for n in alloc if alloc[n] > lo[n] and alloc[n] - ideal[n] > band]
        takers = [n for n in alloc if alloc[n] < by_name[n].max_cells and ideal[n] - alloc[n] > band]
        if not donors or not takers:
            break
        d = max(donors, key=lambda n: (alloc[n] - ideal[n], n))
        t = max(takers, key=lambda n: (ideal[n] - alloc[n], n))
        alloc[d] -= 1
        alloc[t] += 1
    return alloc


def _fit_total(alloc: dict[str, int], ideal: Mapping[str, float], lo: Mapping[str, int], total: int) -> None:
    """Cells taken from the jobs most over their share while the sum passes `total`; free cells
    given to the jobs most under theirs (never past an ideal share's ceiling of the maximum)."""
    while sum(alloc.values()) > total:
        over = [n for n in alloc if alloc[n] > lo[n]] or [n for n in alloc if alloc[n] > 0]
        n = max(over, key=lambda n: (alloc[n] - ideal[n], n))
        alloc[n] -= 1
    while sum(alloc.values()) < total:
        under = [n for n in alloc if ideal[n] - alloc[n] > EPS]
        if not under:
            break
        n = max(under, key=lambda n: (ideal[n] - alloc[n], n))
        alloc[n] += 1


def moves(targets: Mapping[str, int], held: Mapping[str, int]) -> list[tuple[str, str]]:
    """(from job, to job), one pair per cell to move, so that `held` becomes `targets`: the
    largest surplus gives to the largest deficit first (ties by name, so the list is stable)."""
    surplus = {n: held.get(n, 0) - t for n, t in targets.items() if held.get(n, 0) > t}
    for n, h in held.items():
        if n not in targets and h > 0:
            surplus[n] = h  # a job no longer divided (deleted) gives all it holds
    deficit = {n: t - held.get(n, 0) for n, t in targets.items() if t > held.get(n, 0)}
    out: list[tuple[str, str]] = []
    while surplus and deficit:
        d = max(surplus, key=lambda n: (surplus[n], n))
        t = max(deficit, key=lambda n: (deficit[n], n))
        out.append((d, t))
        for book, n in ((surplus, d), (deficit, t)):
            book[n] -= 1
            if book[n] == 0:
                del book[n]
    return out

"""Dividing one fleet between several RL jobs: pure functions of measured demand.

    divide(jobs, total)          -> {job: target cells}     mins, max, weights, hysteresis, move cost
    moves(targets, held)         -> [(from_job, to_job)]    one pair per cell to move
    cells_to_release(cells, n)   -> [cell_id]               which of a job's cells leave it
    demand_cells(...)            -> float                   a job's measured demand, in cells

One line: each job's minimum first -> the rest by weight, water-filled up to each job's demand
and maximum (a job that wants less leaves its share to those that want more) -> from the cells
each job holds now, move only where a job is short of its share by more than the hysteresis
band and the cell's expected use over the horizon outweighs the move (drain + weight load) ->
cells taken from the free pool first, then from the jobs most over their share.

Within a job, rollout vs training stays `scheduler.planner.plan`'s decision, on the same
snapshot. No I/O, no clocks, no randomness, no mutation of the inputs (docs/JOBS.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.planner.types import CellId, CellSummary

FREE = ""
"""The job name `moves` uses for cells no job holds (the free pool)."""
_EPS = 1e-9


class JobShareError(ValueError):
    """The jobs or the fleet size given to `divide` or `moves` are inconsistent; says which."""


@dataclass(frozen=True)
class JobShare:
    name: str
    min_cells: int
    max_cells: int
    weight: float
    demand_cells: float
    """Cells the job's measured demand could use now (rollout + training)."""
    held: int
    """Cells it holds now (cells moving in count for the destination)."""


def demand_cells(arrivals_per_s: float, slot_s_per_session: float, capacity: int,
                 train_cell_s_per_session: float, *, live_sessions: float | None = None,
                 lead_s: float = 0.0) -> float:
    """Cells a job could use now (rollout + training), from measured rates.

    Without `live_sessions`: the steady state of the arrival rate (refused arrivals included):
    arrivals x slot time / slots a cell, plus the training cells that keep up with them. With
    them: the slots its live sessions hold now, grown by the arrivals beyond the finishes over
    `lead_s` (a rising job asks ahead, a falling one keeps the slots its sessions still hold),
    plus training at the live sessions' finish rate."""
    if min(arrivals_per_s, slot_s_per_session, train_cell_s_per_session, lead_s) < 0 or capacity <= 0:
        raise JobShareError("demand needs rates >= 0 and a capacity > 0")
    if live_sessions is None:
        return arrivals_per_s * (slot_s_per_session / capacity + train_cell_s_per_session)
    finishes = live_sessions / slot_s_per_session if slot_s_per_session > 0 else 0.0
    slots = live_sessions + max(0.0, arrivals_per_s - finishes) * lead_s
    return slots / capacity + finishes * train_cell_s_per_session


def _check(jobs: Sequence[JobShare], total: int) -> None:
    if total < 0:
        raise JobShareError(f"total cells must be >= 0, got {total}")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names) or FREE in names:
        raise JobShareError(f"job names must be unique and non-empty, got {names}")
    for j in jobs:
        if not 0 <= j.min_cells <= j.max_cells:
            raise JobShareError(f"job {j.name!r}: need 0 <= min_cells <= max_cells, got "
                                f"{j.min_cells}, {j.max_cells}")
        if not (j.weight > 0 and math.isfinite(j.weight)):
            raise JobShareError(f"job {j.name!r}: weight must be > 0, got {j.weight}")
        if not (j.demand_cells >= 0) or j.held < 0:
            raise JobShareError(f"job {j.name!r}: demand_cells and held must be >= 0")
    if sum(j.min_cells for j in jobs) > total:
        raise JobShareError(f"the jobs' min_cells sum to {sum(j.min_cells for j in jobs)}, "
                            f"more than the {total} cells of the fleet")
    if sum(j.held for j in jobs) > total:
        raise JobShareError(f"the jobs hold {sum(j.held for j in jobs)} cells, more than {total}")


def _cap(j: JobShare) -> int:
    """Most cells the job should get: its demand (whole cells), within [min, max]."""
    want = math.ceil(j.demand_cells - _EPS) if math.isfinite(j.demand_cells) else j.max_cells
    return max(j.min_cells, min(j.max_cells, want))


def water_fill(jobs: Sequence[JobShare], total: int) -> dict[str, float]:
    """Fractional shares: each job max(min, min(cap, level x weight)), the level chosen so the
    shares sum to the fleet (or every job is at its cap)."""
    caps = {j.name: _cap(j) for j in jobs}

    def at(level: float) -> dict[str, float]:
        return {j.name: max(j.min_cells, min(caps[j.name], level * j.weight)) for j in jobs}

    if not jobs or sum(caps.values()) <= total:
        return {j.name: float(caps[j.name]) for j in jobs}
    lo, hi = 0.0, max(caps.values()) / min(j.weight for j in jobs)
    for _ in range(100):  # the sum is monotone in the level
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(at(mid).values()) < total else (lo, mid)
    return at(hi)


def ideal_targets(jobs: Sequence[JobShare], total: int) -> dict[str, int]:
    """`water_fill` in whole cells (largest remainders), mins and caps kept."""
    _check(jobs, total)
    share = water_fill(jobs, total)
    out = {n: math.floor(v + _EPS) for n, v in share.items()}
    caps = {j.name: _cap(j) for j in jobs}
    left = min(total, sum(caps.values())) - sum(out.values())
    for n in sorted(share, key=lambda n: (out[n] - share[n], n)):
        if left <= 0:
            break
        if out[n] < caps[n]:
            out[n] += 1
            left -= 1
    return out


def divide(jobs: Sequence[JobShare], total: int, *, hysteresis_cells: float = 1.0,
           move_cost_s: float = 0.0, horizon_s: float = 600.0) -> dict[str, int]:
    """Target cells per job (sums to <= total; mins first, max respected, rest by weight up to demand).

    From what each job holds: a job over its max sheds the excess and a job under its min is
    raised to it whatever the band or the cost; otherwise a job gets cells only while it is
    short of its ideal share by more than `hysteresis_cells`, and each cell only while its
    expected use there over `horizon_s` (the share of it the job's demand fills) exceeds the
    move's cost: use x (horizon - move_cost_s) > move_cost_s. Cells come from the free pool
    first, then from the jobs most over their ideal share (never below it, nor below a min).
    Cells left in the free pool go to jobs short of their share within the band as well (a
    free cell drains nothing), the move's cost still counted."""
    if move_cost_s < 0 or horizon_s <= 0 or hysteresis_cells < 0:
        raise JobShareError("need move_cost_s >= 0, horizon_s > 0, hysteresis_cells >= 0")
    ideal = ideal_targets(jobs, total)
    by = {j.name: j for j in jobs}
    target = {j.name: min(j.held, j.max_cells) for j in jobs}
    free = total - sum(target.values())
    for j in sorted(jobs, key=lambda j: j.held - j.min_cells):  # mins, forced
        while target[j.name] < j.min_cells:
            free = _take(target, ideal, by, free, j.name, floor="min")
    short = [j for j in jobs if ideal[j.name] - target[j.name] > hysteresis_cells]
    for j in sorted(short, key=lambda j: ((target[j.name] - ideal[j.name]) / j.weight, j.name)):
        while target[j.name] < ideal[j.name]:
            use = min(1.0, max(0.0, j.demand_cells - target[j.name]))
            if use * (horizon_s - move_cost_s) <= move_cost_s:
                break  # the next cell's use does not pay for its move
            if free <= 0 and not _donor(target, ideal, by, "ideal"):
                break
            free = _take(target, ideal, by, free, j.name, floor="ideal")
    for j in sorted(jobs, key=lambda j: ((target[j.name] - ideal[j.name]) / j.weight, j.name)):
        while free > 0 and target[j.name] < ideal[j.name]:  # free cells drain nothing: no band
            if min(1.0, max(0.0, j.demand_cells - target[j.name])) * (horizon_s - move_cost_s) <= move_cost_s:
                break
            target[j.name] += 1
            free -= 1
    return target


def _donor(target: dict[str, int], ideal: dict[str, int], by: Mapping[str, JobShare],
           floor: str) -> str | None:
    """The job most over its ideal share that can give a cell (down to its ideal share, or
    down to its min when `floor` is "min")."""
    def lowest(n: str) -> int:
        return by[n].min_cells if floor == "min" else max(ideal[n], by[n].min_cells)

    able = [n for n in target if target[n] > lowest(n)]
    if not able:
        return None
    return max(able, key=lambda n: ((target[n] - ideal[n]) / by[n].weight, n))


def _take(target: dict[str, int], ideal: dict[str, int], by: Mapping[str, JobShare], free: int,
          to: str, floor: str) -> int:
    """One cell to `to`: from the free pool, else from `_donor`. Returns the free pool left."""
    if free > 0:
        target[to] += 1
        return free - 1
    donor = _donor(target, ideal, by, floor)
    if donor is None or donor == to:
        raise JobShareError(f"no cell can move to job {to!r}")  # mins sum <= total: unreachable
    target[donor] -= 1
    target[to] += 1
    return free


def moves(targets: Mapping[str, int], held: Mapping[str, int]) -> list[tuple[str, str]]:
    """(from_job, to_job) pairs, one per cell to move, that take `held` to `targets`.

    `FREE` ("") stands for the free pool: cells a job gains beyond what others give come from
    it, cells a job gives beyond what others take go back to it. Largest gaps are paired first."""
    names = set(targets) | set(held)
    if any(v < 0 for v in (*targets.values(), *held.values())) or FREE in names:
        raise JobShareError("targets and held must be >= 0 and name jobs (not the free pool)")
    gain = {n: targets.get(n, 0) - held.get(n, 0) for n in sorted(names)}
    givers = sorted(((-d, n) for n, d in gain.items() if d < 0), reverse=True)
    takers = sorted(((d, n) for n, d in gain.items() if d > 0), reverse=True)
    give = [n for d, n in givers for _ in range(d)]
    take = [n for d, n in takers for _ in range(d)]
    out = list(zip(give, take))
    out += [(n, FREE) for n in give[len(take):]]
    out += [(FREE, n) for n in take[len(give):]]
    return out


def _release_rank(c: CellSummary) -> tuple:
    """Cheapest to take from a job first: idle rollout-side cells, idle training cells, busy
    training cells, then rollout cells by fewest live rollouts and fewest tokens to move."""
    if c.role == "training" or c.role == "draining":
        return (1, int(c.busy), 0, 0)
    if c.inflight == 0:
        return (0, 0, 0, 0)
    return (2, 0, c.inflight, c.inflight_tokens)


def cells_to_release(cells: Sequence[CellSummary], count: int) -> list[CellId]:
    """The `count` cells of one job that leave it (`_release_rank` order; ties by id as text)."""
    if count < 0 or count > len(cells):
        raise JobShareError(f"cannot release {count} of {len(cells)} cells")
    ranked = sorted(cells, key=lambda c: (_release_rank(c), str(c.cell_id)))
    return [c.cell_id for c in ranked[:count]]

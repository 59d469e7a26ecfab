"""An RL job's settings (docs/JOBS.md): which it may carry, their checks, and what its
trainer trains with (its objective over the trainer's configured one, its staleness bound)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Invalid

if TYPE_CHECKING:
    from scheduler.contract.config.scheduler import SchedulerConfig
    from scheduler.store.jobs import JobRow

SETTINGS_KEYS = ("objective", "staleness_bound", "staleness_policy", "min_rollout_cells", "max_sessions", "drain_s",
                 "seed", "task")
"""Per-job settings a job may carry (anything else is refused)."""
POLICIES = ("correct", "drop")
"""A job's `staleness_policy` (the fleet's `scheduler.staleness_policy` values)."""


def check(settings: dict[str, Any], max_cells: int | None = None) -> None:
    """422 for unknown settings, an `objective` that is neither an object nor a name, a
    `staleness_bound` / `max_sessions` / `min_rollout_cells` that is no whole number in range
    (`min_rollout_cells` at most the job's `max_cells`), or a `staleness_policy` other than
    `correct` / `drop` (the trainer checks the objective's keys when it starts)."""
    if not isinstance(settings, dict):
        raise Invalid("settings: an object of the job's settings")
    bad = sorted(set(settings) - set(SETTINGS_KEYS))
    if bad:
        raise Invalid(f"unknown job settings {bad} (known: {', '.join(SETTINGS_KEYS)})")
    obj = settings.get("objective")
    if obj is not None and not isinstance(obj, dict) and not (isinstance(obj, str) and 0 < len(obj) <= 64):
        raise Invalid("settings.objective: an object of the trainer's objective keys, or an advantage's name "
                      "(`grpo`, `rloo`; docs/RL.md)")
    for key, lo in (("staleness_bound", 0), ("max_sessions", 1), ("min_rollout_cells", 0)):
        v = settings.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 1 << 30):
            raise Invalid(f"settings.{key}: a whole number from {lo}, got {v!r}")
    floor = settings.get("min_rollout_cells")
    if floor is not None and max_cells is not None and floor > max_cells:
        raise Invalid(f"settings.min_rollout_cells {floor} is above the job's max_cells {max_cells}")
    policy = settings.get("staleness_policy")
    if policy is not None and policy not in POLICIES:
        raise Invalid(f"settings.staleness_policy: one of {', '.join(POLICIES)}, got {policy!r}")


def merged(own: dict[str, Any], patch: dict[str, Any], max_cells: int | None) -> dict[str, Any]:
    """A job's settings with `patch` over `own` (None: the key removed, the fleet's default
    again), checked whole; `own` is left as it was."""
    if not isinstance(patch, dict) or not patch:
        raise Invalid("settings: a non-empty object of the job's settings to change")
    out = {k: v for k, v in {**own, **patch}.items() if v is not None}
    check(out, max_cells)
    return out


def trainer_view(cfg: SchedulerConfig, row: JobRow) -> dict[str, Any]:
    """What the job's trainer trains with: its `objective` (None: the trainer's configured
    one; otherwise its keys override that one's; a name is the advantage's `type`) and the
    staleness bound and policy applied to it, and the rollout cells its flips keep."""
    obj = row.settings.get("objective")
    return {"objective": {"advantage": {"type": obj}} if isinstance(obj, str) else obj,
            "staleness_bound": staleness_bound(cfg, row), "staleness_policy": staleness_policy(cfg, row),
            "min_rollout_cells": min_rollout_cells(cfg, row)}


def staleness_bound(cfg: SchedulerConfig, row: JobRow | None) -> int:
    """A job's staleness bound: its `settings.staleness_bound`, else the fleet's."""
    own = row.settings.get("staleness_bound") if row is not None else None
    return cfg.staleness_bound if own is None else int(own)


def staleness_policy(cfg: SchedulerConfig, row: JobRow | None) -> str:
    """A job's `staleness_policy` (past its bound: `correct` or `drop`), else the fleet's."""
    own = row.settings.get("staleness_policy") if row is not None else None
    return cfg.staleness_policy if own is None else str(own)


def min_rollout_cells(cfg: SchedulerConfig, row: JobRow | None) -> int:
    """The rollout cells a job's flips keep on a shared fleet: its `settings.min_rollout_cells`,
    else the fleet's `scheduler.min_rollout_cells`."""
    own = row.settings.get("min_rollout_cells") if row is not None else None
    return cfg.min_rollout_cells if own is None else int(own)

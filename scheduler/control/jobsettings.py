"""An RL job's settings (docs/JOBS.md): which it may carry, their checks, and what its
trainer trains with (its objective over the trainer's configured one, its staleness bound)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Invalid

if TYPE_CHECKING:
    from scheduler.contract.config.scheduler import SchedulerConfig
    from scheduler.store.jobs import JobRow

SETTINGS_KEYS = ("objective", "staleness_bound", "max_sessions", "drain_s", "seed", "task")
"""Per-job settings a job may carry (anything else is refused)."""


def check(settings: dict[str, Any]) -> None:
    """422 for unknown settings, an `objective` that is neither an object nor a name, or a
    `staleness_bound` / `max_sessions` that is no whole number in range (the trainer checks
    the objective's keys when it starts)."""
    bad = sorted(set(settings) - set(SETTINGS_KEYS))
    if bad:
        raise Invalid(f"unknown job settings {bad} (known: {', '.join(SETTINGS_KEYS)})")
    obj = settings.get("objective")
    if obj is not None and not isinstance(obj, dict) and not (isinstance(obj, str) and 0 < len(obj) <= 64):
        raise Invalid("settings.objective: an object of the trainer's objective keys, or an advantage's name "
                      "(`grpo`, `rloo`; docs/RL.md)")
    for key, lo in (("staleness_bound", 0), ("max_sessions", 1)):
        v = settings.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 1 << 30):
            raise Invalid(f"settings.{key}: a whole number from {lo}, got {v!r}")


def trainer_view(cfg: SchedulerConfig, row: JobRow) -> dict[str, Any]:
    """What the job's trainer trains with: its `objective` (None: the trainer's configured
    one; otherwise its keys override that one's; a name is the advantage's `type`) and the
    staleness bound applied to it."""
    obj = row.settings.get("objective")
    return {"objective": {"advantage": {"type": obj}} if isinstance(obj, str) else obj,
            "staleness_bound": staleness_bound(cfg, row), "staleness_policy": cfg.staleness_policy}


def staleness_bound(cfg: SchedulerConfig, row: JobRow | None) -> int:
    """A job's staleness bound: its `settings.staleness_bound`, else the fleet's."""
    own = row.settings.get("staleness_bound") if row is not None else None
    return cfg.staleness_bound if own is None else int(own)

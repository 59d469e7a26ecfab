"""A trainer of an RL job trains with its job's objective (GET /v1/jobs `trainer` block) over
its configured one, and spans the EWMA window over its job's staleness bound."""

from __future__ import annotations

from cells.trainer.trainer import resolved_objective
from scheduler.contract.config import parse_config


def test_the_jobs_objective_keys_override_the_configured_ones():
    cfg = parse_config({"trainer": {"objective": {"clip_low": 0.1}}, "scheduler": {"staleness_bound": 4}})
    mine = resolved_objective(cfg, {"objective": {"clip_high": 0.28, "advantage": {"type": "rloo"}},
                                    "staleness_bound": 1})
    fleet = resolved_objective(cfg)  # control: no job view, the configured objective as before
    assert (mine.clip_low, mine.clip_high, mine.advantage.type) == (0.1, 0.28, "rloo")
    assert (fleet.clip_low, fleet.clip_high, fleet.advantage.type) == (0.1, 0.2, "grpo")
    assert resolved_objective(cfg, {"objective": None, "staleness_bound": 4}) == fleet  # a job with none set
    assert mine.ewma.staleness_window != fleet.ewma.staleness_window  # the job's bound, not the fleet's

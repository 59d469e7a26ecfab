"""Discrete-event cluster simulator: cells, sessions and a trainer, driven by the planner.

Model (what the figures of bench/cluster_sim.py rest on):
- A rollout cell holds `cell_capacity` sessions; a session occupies its slot for a
  log-normal time and its context grows linearly to `session_tokens`. Agent harnesses always
  have sessions waiting, so every free slot is refilled at the next controller tick (60 s by
  default; the same for every policy).
- Finishes and training events happen at their exact times; flips, migrations,
  resumptions and admissions happen at ticks, as the production controller does them.
- Training (trainer.py): a step costs `step_cell_hours` spread over its cells, at most
  `max_cells_per_step` of them. Asynchronous policies run several steps at once when they
  have more cells (each on its own batch, each a new version); `sync` runs its steps one
  after another, one on-policy chain per load.
- Staleness: an asynchronous policy drops a session more than `staleness_bound` versions old
  when it finishes, and a waiting one that crosses the bound before a step takes it (no
  session is trained beyond the bound). `sync` trains every session of its load and its
  staleness is reported, not bounded.
- Moves: a KV copy pauses the session for bytes / link bandwidth, a re-prefill for
  tokens / prefill rate (those tokens count as recomputed); a suspended session resumes by
  re-prefill when a slot frees. Drains finish within the tick (well under a second here).
- Weight versions reach rollout cells while they decode; a cell entering rollout loads for
  `broadcast_s` first. Per-cell versions are therefore all current and not modelled.
"""

from .policies import POLICIES, Oracle, Planned, Policy, Static, Sync, make_policy
from .run import RunResult, run_policy
from .workload import BUILTIN, Workload, WorkloadError, load_workload

__all__ = ["BUILTIN", "POLICIES", "Oracle", "Planned", "Policy", "RunResult", "Static", "Sync", "Workload",
           "WorkloadError", "load_workload", "make_policy", "run_policy"]

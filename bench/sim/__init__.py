"""Discrete-event cluster simulator: cells, sessions and a trainer, driven by the planner.

Model (what the figures of bench/cluster_sim.py rest on):
- A rollout cell holds `cell_capacity` sessions; a session occupies its slot for a
  log-normal time whose mean may drift, step or oscillate (workload.py), and holds tokens in
  proportion to its own slot time (context grows linearly while it decodes). Agent
  harnesses always have sessions waiting, so every free slot is refilled at the next
  controller tick (the workload's `tick_s`, the same for every policy).
- Finishes and training events happen at their exact times; flips, migrations,
  resumptions and admissions happen at ticks, as the production controller does them.
- Training (trainer.py): one RL update at a time, one version each, over `batch_size`
  sessions (growing with the fleet); its work is per token, spread over the training cells
  (at most a step's width) with a strong-scaling efficiency. Staleness: a session more than
  `staleness_bound` versions old is dropped when it finishes or while it waits; `sync` has
  no bound (each round is on-policy).
- Moves (cluster.py): a KV copy costs bytes / link bandwidth at both ends; a re-prefill
  costs the destination the prefill time from context length and model size; an abort
  restarts the session from its prompt (its tokens discarded); a suspended session resumes
  by re-prefill when a slot frees. The oracle's moves are free.
- Weight versions reach rollout cells while they decode; a cell entering rollout loads for
  `broadcast_s` first. Per-cell versions are therefore all current and not modelled.
- Measurements: the planner's `Snapshot` carries rates measured by the controller's own
  `scheduler.control.rates.Rates`, fed what the simulator observes, as the scheduler feeds it.
"""

from .policies import POLICIES, Oracle, Planned, Policy, Static, Sync, make_policy
from .run import RunResult, run_policy
from .workload import BUILTIN, Workload, WorkloadError, load_workload

__all__ = ["BUILTIN", "POLICIES", "Oracle", "Planned", "Policy", "RunResult", "Static", "Sync", "Workload",
           "WorkloadError", "load_workload", "make_policy", "run_policy"]

"""The four ways of sharing cells between rollout and training that the simulator compares.

- `sync`: every cell starts a full load of sessions; when the last finishes, every cell
  trains on them one step at a time (verl-like colocated), then loads the new weights.
- `static`: a fixed rollout/training split, continuous admission, asynchronous training
  within the staleness bound (AReaL-like).
- `flip_abort`: `scheduler.planner.plan_flips` decides; moved sessions are re-prefilled
  (no KV export), as in today's partial flips.
- `cellflip`: `plan_flips` decides; moved sessions go by live KV copy, or are suspended.
"""

from __future__ import annotations

from scheduler.planner import plan_flips
from scheduler.planner_types import FlipDecision, PlannerPolicy, Snapshot

from .cluster import LOADING, ROLLOUT, TRAINING, Cluster


class Policy:
    name = "policy"
    sequential = False
    """One training step at a time, no staleness bound (synchronous training)."""
    can_export_kv = True

    def start(self, cl: Cluster) -> None:
        """Initial roles at t = 0."""

    def tick(self, cl: Cluster, t: float, rates: dict[str, float]) -> None:
        """Controller decisions at a tick (after finishes, before admission)."""

    def admits(self, cl: Cluster, t: float) -> bool:
        """Whether free slots take new sessions at this tick."""
        return True


class Sync(Policy):
    name = "sync"
    sequential = True

    def __init__(self) -> None:
        self.phase = "rollout"
        self._admit = True

    def tick(self, cl: Cluster, t: float, rates: dict[str, float]) -> None:
        tr = cl.trainer
        if self.phase == "rollout" and int(cl.inflight.sum()) == 0:
            cl.set_roles(list(range(cl.n)), TRAINING, t)
            cl.sync_trainer_cells(t)
            self.phase = "training"
        elif self.phase == "training" and not tr.steps and tr.queue.size < tr.batch_size:
            cl.set_roles(list(range(cl.n)), LOADING, t)
            cl.sync_trainer_cells(t)
            self.phase, self._admit = "rollout", True

    def admits(self, cl: Cluster, t: float) -> bool:
        admit, self._admit = self._admit, False
        return admit


class Static(Policy):
    name = "static"

    def __init__(self, rollout_fraction: float) -> None:
        self.rollout_fraction = rollout_fraction

    def start(self, cl: Cluster) -> None:
        n_roll = max(1, round(self.rollout_fraction * cl.n))
        cl.set_roles(list(range(n_roll, cl.n)), TRAINING, 0.0)
        cl.sync_trainer_cells(0.0)


class Planned(Policy):
    """Flips decided by `plan_flips`, unchanged; KV export on or off."""

    def __init__(self, name: str, can_export_kv: bool, policy: PlannerPolicy | None = None,
                 record: bool = False) -> None:
        self.name = name
        self.can_export_kv = can_export_kv
        self.policy = policy or PlannerPolicy()
        self.flips = 0
        self.log: list[tuple[Snapshot, list[FlipDecision]]] | None = [] if record else None

    def tick(self, cl: Cluster, t: float, rates: dict[str, float]) -> None:
        snap = cl.snapshot(t, **rates)
        decisions = plan_flips(snap, self.policy)
        if self.log is not None:
            self.log.append((snap, decisions))
        if not decisions:
            return
        to_train = [int(d.cell_id) for d in decisions if d.to == "training"]
        to_roll = [int(d.cell_id) for d in decisions if d.to == "rollout"]
        assert all(cl.role[c] == ROLLOUT for c in to_train), "planner flipped a non-rollout cell"
        assert all(cl.role[c] == TRAINING for c in to_roll), "planner flipped a non-training cell"
        # a drain moves KV in well under a second (20k tokens: 4 ms on NVLink, 39 ms between
        # nodes), so a flipped cell is modelled as training from this tick on
        cl.set_roles(to_train, TRAINING, t)
        cl.set_roles(to_roll, LOADING, t)
        cl.drain(to_train, t)
        cl.sync_trainer_cells(t)
        self.flips += len(decisions)


def make_policy(name: str, rollout_fraction: float = 0.8, record: bool = False) -> Policy:
    if name == "sync":
        return Sync()
    if name == "static":
        return Static(rollout_fraction)
    if name == "flip_abort":
        return Planned("flip_abort", can_export_kv=False, record=record)
    if name == "cellflip":
        return Planned("cellflip", can_export_kv=True, record=record)
    raise ValueError(f"unknown policy {name!r}; choose from sync, static, flip_abort, cellflip")

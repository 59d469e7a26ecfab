"""The ways of sharing cells between rollout and training that the simulator compares.

- `sync` (as verl runs it): each round fills every slot of the fleet, waits for the round's
  last session, then the whole fleet trains on all of them as one on-policy update, then
  loads the new weights. A round times out as its users set it: at `sync_timeout_mean_x`
  times the mean slot time (the sessions still running are cut, their tokens discarded).
  `sync_p99`: the same, cutting the round at the p99 slot time. `sync_same_batch`: rounds
  of the asynchronous policies' batch (`Workload.batch_for`), not of the whole fleet's slots.
- `static`: a fixed rollout/training split, continuous admission, asynchronous training
  within the staleness bound (AReaL-like).
- `flip_abort`: `scheduler.planner.plan.plan_flips` decides; a flip aborts its cell's rollouts,
  which restart from the prompt elsewhere (progress lost), as verl and ROLL do today.
- `flip_reprefill`: the planner decides; a flip re-prefills its rollouts elsewhere, keeping
  their tokens, the prefill paid by the destination cell.
- `Replayed`: another run's flips, tick by tick, moving sessions its own way: the paired twin
  that compares live KV migration with re-prefill on the same sessions and roles.
- `cellflip`: the planner decides; a flip moves its rollouts by live KV copy, paid by both ends.
- `oracle`: a ceiling, sharing no code with the planner: every tick it gives the trainer the
  cells that balance production against training (while a step runs or a batch is ready),
  production taken from the workload's true model or from the finishes it knows are coming,
  and moves cells and sessions at no time and no cost; the bench keeps the better of the two.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.control.rates import Rates
from scheduler.planner.plan import follows_new_sessions, plan_flips
from scheduler.planner.types import FlipDecision, PlannerPolicy, Snapshot

from .cluster import LOADING, ROLLOUT, TRAINING, Cluster

POLICIES = ("sync", "sync_p99", "sync_same_batch", "static", "flip_abort", "flip_reprefill", "cellflip", "oracle")


class Policy:
    name = "policy"
    mode = "kv"
    """How a flip moves sessions (see `Cluster`)."""
    is_sync = False
    """Synchronous rounds: no staleness bound, the whole fleet trains each round."""

    def start(self, cl: Cluster) -> None:
        """Initial roles at t = 0."""

    def tick(self, cl: Cluster, t: float, rates: Rates) -> None:
        """Controller decisions at a tick (after finishes, before admission)."""

    def admits(self, cl: Cluster, t: float) -> bool:
        """Whether free slots take new sessions at this tick."""
        return True

    def admit_limit(self, cl: Cluster, t: float) -> int | None:
        """At most this many new sessions at this tick (None: every free slot)."""
        return None


class Sync(Policy):
    is_sync = True

    def __init__(self, timeout_quantile: float | None = None, same_batch: bool = False) -> None:
        self.name = ("sync" if timeout_quantile is None else f"sync_p{round(timeout_quantile * 100)}") + (
            "_same_batch" if same_batch else "")
        self.timeout_quantile = timeout_quantile
        self.same_batch = same_batch
        self.batch: int | None = None
        self.phase = "rollout"
        self._admit = True
        self.round_start = 0.0

    def start(self, cl: Cluster) -> None:
        # the asynchronous policies' batch (the trainer's is the round's: set at each round's end)
        self.batch = cl.wl.batch_for(cl.n)[0] if self.same_batch else None

    def admit_limit(self, cl: Cluster, t: float) -> int | None:
        return self.batch

    def _limit_s(self, cl: Cluster) -> float:
        """The round's timeout: the p-quantile cut, else the users' (`sync_timeout_mean_x`)."""
        if self.timeout_quantile is not None:
            return cl.wl.quantile_s(self.timeout_quantile, self.round_start, cl.horizon_s)
        return cl.wl.sync_timeout_mean_x * float(cl.wl.mean_hours_at(self.round_start, cl.horizon_s)) * 3600.0

    def tick(self, cl: Cluster, t: float, rates: Rates) -> None:
        tr = cl.trainer
        if self.phase == "rollout":
            if int(cl.inflight.sum()) and t >= self.round_start + self._limit_s(cl):
                cl.abort_all(t)
            if int(cl.inflight.sum()) == 0:
                if tr.queue.size == 0:
                    self._admit = True  # nothing finished (all cut): start the round again
                    self.round_start = t
                    return
                tr.batch_size = tr.queue.size  # one update on every session of the round
                cl.set_roles(list(range(cl.n)), TRAINING, t)
                cl.sync_trainer_cells(t)
                self.phase = "training"
        elif self.phase == "training" and tr.step is None:
            cl.set_roles(list(range(cl.n)), LOADING, t)
            cl.sync_trainer_cells(t)
            self.phase, self._admit = "rollout", True
            self.round_start = t + cl.wl.broadcast_s

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
    """Flips decided by `plan_flips`, unchanged; sessions moved the way `mode` says. Under the
    planner that follows the sessions starting now (`follows_new_sessions`: asked, or a fast
    wave), while sessions are parked (suspended) the fewest new ones that keep that rate
    measured still start each tick ahead of them: one cell's slots per window of new sessions
    (`Rates.new_window_s`; 2 a tick at 2 h sessions; 16 a tick held 0.948 of the oracle on
    `sinusoidal`, seeds 1-3, where 2 hold 0.969); otherwise parked sessions resume first (new
    ones ahead of them cost `arrive_leave` 0.41 -> 0.29 of its gain capture)."""

    def __init__(self, name: str, mode: str, policy: PlannerPolicy | None = None,
                 record: bool = False) -> None:
        self.name = name
        self.mode = mode
        self.policy = policy or PlannerPolicy()
        self.flips = 0
        self.log: list[tuple[Snapshot, list[FlipDecision]]] | None = [] if record else None
        self.trace: dict[float, list[FlipDecision]] = {}
        """Every tick's flips by tick time (what `Replayed` applies to a paired run)..."""
        self.fresh: dict[float, int] = {}
        """...and the new sessions it started ahead of parked ones, by tick time."""

    def view(self, cl: Cluster, t: float, snap: Snapshot) -> Snapshot:
        """What the planner is shown: the measured snapshot (bench/sim/probe.py shows it more)."""
        return snap

    def tick(self, cl: Cluster, t: float, rates: Rates) -> None:
        snap = self.view(cl, t, cl.snapshot(t, rates))
        decisions = plan_flips(snap, self.policy)
        if self.log is not None:
            self.log.append((snap, decisions))
        if decisions:
            self.trace[t] = decisions
        self._flip(cl, t, decisions)
        if cl.suspended and follows_new_sessions(snap, self.policy):
            self.fresh[t] = math.ceil(cl.k * cl.tick_s / rates.new_window_s())
            cl.admit(t, self.fresh[t])

    def _flip(self, cl: Cluster, t: float, decisions: list[FlipDecision]) -> None:
        if not decisions:
            return
        to_train = [int(d.cell_id) for d in decisions if d.to == "training"]
        to_roll = [int(d.cell_id) for d in decisions if d.to == "rollout"]
        assert all(cl.role[c] == ROLLOUT for c in to_train), "planner flipped a non-rollout cell"
        assert all(cl.role[c] == TRAINING for c in to_roll), "planner flipped a non-training cell"
        cl.set_roles(to_train, TRAINING, t)
        cl.set_roles(to_roll, LOADING, t)
        cl.sync_trainer_cells(t)
        cl.drain(to_train, t)  # after the trainer has the cells: a KV copy delays its step
        self.flips += len(decisions)


class Replayed(Planned):
    """Another run's flips (and new sessions started ahead of parked ones), tick by tick, with
    this run's way of moving sessions (`mode`): the paired twin of a planned run. Same seed,
    so the same sessions in the same order (each
    admission's slot time is the next draw of the seed's stream: common random numbers), and
    the same roles at every tick, so the two runs differ by how moved sessions travel only (a
    KV copy paid by both ends, or a re-prefill paid by the destination). A recorded flip whose
    cell is not in the role it left in the recorded run is skipped and counted (`skipped`;
    roles change by flips and weight loads alone, so it stays 0)."""

    def __init__(self, name: str, mode: str, trace: dict[float, list[FlipDecision]],
                 fresh: dict[float, int] | None = None) -> None:
        super().__init__(name, mode)
        self.replay, self.replay_fresh = trace, fresh or {}
        self.skipped = 0

    def tick(self, cl: Cluster, t: float, rates: Rates) -> None:
        want = {"training": ROLLOUT, "rollout": TRAINING}
        decisions = self.replay.get(t, [])
        ok = [d for d in decisions if cl.role[int(d.cell_id)] == want[d.to]]
        self.skipped += len(decisions) - len(ok)
        self._flip(cl, t, ok)
        if cl.suspended and t in self.replay_fresh:
            cl.admit(t, self.replay_fresh[t])


class Oracle(Policy):
    """A ceiling: free moves, a look ahead at the finishes to come. No planner code.

    `source` says what sizes training: "model" (the workload's true mean slot time of the
    sessions starting now) or "finishes" (the sessions the oracle knows will finish within
    `FINISH_TICKS` ticks, per rollout cell). Neither dominates: the model leads a drift (it
    opens rollout slots when short sessions start, `sinusoidal`), the finishes follow a step
    (`step_change`). The bench reports the better of the two per seed (`ORACLE_SOURCES`)."""

    name = "oracle"
    mode = "free"
    BACKLOG_BATCHES = 1.25
    """Batches of work kept waiting or in training, so that a step finds the next one ready."""
    BACKLOG_STEPS = 2.0
    """A backlog off its target is brought back over about this many steps (more or fewer cells)."""
    HOLD = 0.05
    """A target within this share of the training cells (at least 2) changes nothing."""
    LOOKAHEAD_TICKS = 3
    """Training cells stay while a batch completes within this many ticks (the oracle knows)."""
    FINISH_TICKS = 10
    """Ticks of known finishes that measure production (source "finishes")."""

    def __init__(self, source: str = "model") -> None:
        if source not in ORACLE_SOURCES:
            raise ValueError(f"oracle source must be one of {ORACLE_SOURCES}, got {source!r}")
        self.source = source
        self.flips = 0

    def _rollout_cell_s_per_session(self, cl: Cluster, t: float) -> tuple[float, float]:
        """(rollout cell-seconds a session, tokens a session) by `source`."""
        wl = cl.wl
        if self.source == "model":
            return float(wl.mean_hours_at(t, cl.horizon_s)) * 3600.0 / cl.k, float(wl.session_tokens)
        h = self.FINISH_TICKS * cl.tick_s
        fin = cl.end <= t + h
        n_roll = max(1, int((cl.role == ROLLOUT).sum()))
        per_cell = float(fin.sum()) / h / n_roll
        tok = float(cl.tok[fin].mean()) if fin.any() else float(wl.session_tokens)
        return 1.0 / max(per_cell, 1e-12), tok

    def tick(self, cl: Cluster, t: float, rates: Rates) -> None:
        tr = cl.trainer
        # the oracle knows which sessions finish in the next few ticks
        soon = int((cl.end <= t + self.LOOKAHEAD_TICKS * cl.tick_s).sum())
        target = 0
        if tr.step is not None or tr.queue.size + soon >= tr.batch_size:
            a, tok = self._rollout_cell_s_per_session(cl, t)
            b0 = tok * tr.cell_s_per_token  # training cell-s a session, perfect scaling
            c = cl.n * b0 / (a + b0)
            b = b0 / tr.eff(max(1.0, c))
            c = cl.n * b / (a + b)
            # work waiting: the queue plus what the running step has left (smooth across a step's
            # start, where the queue alone drops by a batch)
            s = tr.step
            left = s.sessions * s.work / s.total if s is not None and s.total > 0 else 0.0
            extra = (tr.queue.size + left - self.BACKLOG_BATCHES * tr.batch_size) / (
                self.BACKLOG_STEPS * max(1, tr.batch_size))
            target = min(tr.width, max(1, round(c * (1.0 + max(-0.5, min(1.0, extra))))))
        self._move_to(cl, t, min(target, cl.n - 1))

    def _move_to(self, cl: Cluster, t: float, target: int) -> None:
        training = list(cl.train_order)
        if target and training and abs(target - len(training)) < max(2.0, self.HOLD * target):
            return  # near enough: moving a few cells back and forth only displaces sessions
        if target > len(training):
            pool = np.flatnonzero(cl.role == ROLLOUT)
            add = pool[np.argsort(cl.inflight[pool], kind="stable")][: target - len(training)].tolist()
            cl.set_roles(add, TRAINING, t)
            cl.sync_trainer_cells(t)
            cl.drain(add, t)
            self.flips += len(add)
        elif target < len(training):
            back = training[target:]
            cl.set_roles(back, LOADING, t)
            cl.sync_trainer_cells(t)
            self.flips += len(back)


ORACLE_SOURCES = ("model", "finishes")
"""What sizes the oracle's training side; the bench keeps the better run of the two."""


def make_policy(name: str, rollout_fraction: float = 0.8, record: bool = False) -> Policy:
    if name == "sync":
        return Sync()
    if name == "sync_p99":
        return Sync(0.99)
    if name == "sync_same_batch":
        return Sync(same_batch=True)
    if name == "static":
        return Static(rollout_fraction)
    if name == "flip_abort":
        return Planned("flip_abort", "abort", record=record)
    if name == "flip_reprefill":
        return Planned("flip_reprefill", "reprefill", record=record)
    if name == "cellflip":
        return Planned("cellflip", "kv", record=record)
    if name == "oracle":
        return Oracle()
    if name.startswith("oracle:"):
        return Oracle(name.split(":", 1)[1])
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")

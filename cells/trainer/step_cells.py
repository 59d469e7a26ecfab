"""The cells a training step runs on, and the trainer's demand as the scheduler sees it.

One line: declare a running step (POST /v1/trainer/report) → cells reach the training role →
the step trains on them → report what it took (seconds, sessions, tokens, cells) and that no
step runs.

The report is what the scheduler's staleness bound needs: the batch size gives the admission
rule its unit ((bound + 1) × batch sessions in flight or finished and not fetched), and the
step figures give the planner the training speed. A report also turns the planner's own flips
on (`scheduler.auto_flip`). A trainer that then flipped cells itself raced them: once a step
was declared the planner flipped the cheapest rollout cells while the trainer flipped the
busiest, the trainer's flips were refused (`min_rollout_cells`, or the cell was already
flipping) and, the planner's cells still draining, the step found no training cell and the
coordinator computed it. So one side flips, chosen by the scheduler's answer to the report:

- the planner (auto_flip on): the trainer declares the step and waits until no flip to
  training is under way; it trains on the cells in the training role, at most
  `max_cells_per_step` of them, the ones the scheduler counts busy for a running step (the
  first by id), so the planner does not flip one back mid-step; after the step the planner
  returns the idle ones. If the planner put no cell there, one explicit flip overrides it
  (pinned, flipped back by the trainer after the step): no step waits for want of a
  training cell while one could flip. An override refused (the planner's own flip began
  meanwhile, and the job keeps its rollout cell) is followed by another look, not a failed step.
- the trainer (auto_flip off): it flips `train_cells` cells itself (`train_cell_choice`) and
  flips them back after the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cells.trainer.client import TrainerClient

SETTLE_S = 2.0
"""After declaring a step, the planner gets this long (several of its ticks) to start its flips."""
WAIT_S = 600.0
"""Most seconds a step waits for its cells (flips, drains) before it trains on what it has."""


@dataclass
class StepFigures:
    """What a finished step took (the planner's training speed)."""

    step_s: float
    sessions: int
    tokens: int
    cells: int
    update: dict | None = None
    """The update's figures for the scheduler's metrics (`update_kl`, `grad_norm`, `clip_frac`,
    `entropy`, `staleness`: trained tokens per versions behind), or None."""


class StepCells:
    """Declares the trainer's demand and brings the step's cells to the training role."""

    def __init__(self, client: TrainerClient, *, batch_size: int, train_cells: int, choice: str,
                 emit: Callable[[dict], None], poll_s: float = 0.2) -> None:
        self.client, self.emit, self.poll_s = client, emit, poll_s
        self.batch_size, self.train_cells, self.choice = batch_size, train_cells, choice
        self.planner_flips = False
        """The scheduler runs the planner's flips (its answer to the last report)."""
        self.own: list[str] = []
        """Cells this step flipped explicitly (pinned there until the trainer flips them back)."""
        self.flips_seen: set[str] = set()

    @property
    def width(self) -> int:
        return max(1, self.train_cells)

    def declare(self, steps_in_progress: int, step: StepFigures | None = None, *, untrained: int = 0) -> None:
        """POST /v1/trainer/report (`untrained`: sessions fetched and not trained yet, which the
        staleness admission rule counts); learns from the answer who flips."""
        kw = {} if step is None else {"step_s": step.step_s, "sessions": step.sessions,
                                      "tokens": step.tokens, "cells": step.cells, "update": step.update}
        r = self.client.report_training(batch_size=self.batch_size, steps_in_progress=steps_in_progress,
                                        max_cells_per_step=self.width, untrained=untrained, **kw)
        self.planner_flips = bool(r.get("auto_flip")) and self.train_cells > 0

    # -- before the step ---------------------------------------------------------------------
    def acquire(self, untrained: int = 0) -> list[dict]:
        """Declare the step (`untrained`: sessions fetched and not trained yet, the step's batch
        included) and bring its cells to the training role; returns the explicit flips
        (finished records) it made."""
        self.own = []
        self.declare(1, untrained=untrained)
        if self.train_cells <= 0:
            return []
        if not self.planner_flips:
            return self._flip(self.train_cells)
        deadline = time.monotonic() + WAIT_S
        settle = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            to_training = [f for f in self.client.flips(active=True) if f["to"] == "training"]
            if not to_training and time.monotonic() >= settle:
                if self._in_training():
                    return []
                done = self._flip(1)  # the planner gave none: this flip overrides it
                if done:
                    return done
                # refused (e.g. the planner's own flip of the job's other cell began meanwhile and
                # the job keeps its rollout cell): look again rather than fail the step
                settle = time.monotonic() + SETTLE_S
            time.sleep(self.poll_s)
        return []

    def _flip(self, count: int) -> list[dict]:
        """Explicit flips of `count` rollout cells; a refusal part way (e.g. `min_rollout_cells`)
        keeps the flips already accepted."""
        flips: list[dict] = []
        try:
            if self.choice == "busiest":
                cells = sorted(self._rollout_cells(), key=lambda c: -c.get("inflight", 0))[:count]
                for c in cells:
                    flips += self.client.flip("training", cell=c["id"])
            else:
                flips = self.client.flip("training", count=count)
        except Exception as e:
            self.emit({"event": "flip_refused", "reason": str(e)[:200], "accepted": len(flips)})
        done = self.client.wait_flips(flips, timeout_s=WAIT_S) if flips else []
        self.own = [f["cell"] for f in done if f["state"] == "done"]
        return done

    def _rollout_cells(self) -> list[dict]:
        """The rollout cells this step may flip. A trainer of one RL job on a shared fleet keeps
        one of its job's cells serving its agents (the fleet's `min_rollout_cells` counts every
        job's): while its job holds a single rollout cell (a cell of it moving to another job)
        the step waits, up to WAIT_S, for a second."""
        deadline = time.monotonic() + WAIT_S
        while True:
            rollout = [c for c in self.client.cells() if c["state"] == "rollout"]
            if self.client.job() is None:
                return rollout
            if len(rollout) > 1 or time.monotonic() > deadline:
                return sorted(rollout, key=lambda c: c.get("inflight", 0))[1:]
            time.sleep(max(self.poll_s, 0.5))

    def _in_training(self) -> list[str]:
        return sorted(c["id"] for c in self.client.cells() if c["state"] == "training")

    def group(self) -> list[str]:
        """The step's data-parallel group: the cells this step flipped, then the other cells in
        the training role up to `width`, first by id (those the scheduler keeps busy while the
        step runs; any further one is the planner's to flip back)."""
        try:
            others = [c for c in self._in_training() if c not in self.own]
        except Exception:  # the scheduler briefly unreachable: the flipped cells suffice
            others = []
        return self.own + others[: max(0, self.width - len(self.own))]

    # -- after the step ----------------------------------------------------------------------
    def release(self, cells: list[str], every: bool = False) -> list[dict]:
        """Flip back what the trainer flips (its own cells; every one of `cells` when it flips
        them all, or `every`); the planner returns its own."""
        back = cells if every or not self.planner_flips else [c for c in cells if c in self.own]
        flips: list[dict] = []
        for c in back:
            try:
                flips += self.client.flip("rollout", cell=c)
            except Exception as e:  # already on its way back, or gone: the others go on
                self.emit({"event": "flip_refused", "cell": c, "reason": str(e)[:200]})
        return self.client.wait_flips(flips, timeout_s=WAIT_S) if flips else []

    def hand_back(self) -> list[dict]:
        """The run is over: no step runs (reported), and every cell left in the training role goes
        back to rollout (explicit flips, whoever put it there), so the fleet serves and installs
        the last version."""
        try:
            self.declare(0)
            cells = self._in_training()
        except Exception as e:  # the scheduler gone: nothing to hand back to
            self.emit({"event": "hand_back_failed", "reason": str(e)[:200]})
            return []
        return self.release(cells, every=True)

    def finished_flips(self) -> list[dict[str, Any]]:
        """Flips (by anyone) finished since the last call: what the step record counts."""
        out = []
        for f in self.client.flips():
            if f["id"] not in self.flips_seen and f["state"] in ("done", "failed", "rolled_back"):
                self.flips_seen.add(f["id"])
                out.append(f)
        return out

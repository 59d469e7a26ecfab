"""The simulated trainer: a FIFO of finished trajectories and a fluid model of training steps.

One line: finished sessions queue -> a batch of `batch_size` fresh ones starts a step ->
the step's cell-seconds drain at the rate of the cells it holds -> done: version + 1.

Cells are elastic: the trainer spreads its training cells evenly over the steps it runs,
at most `max_cells_per_step` per step (a step gets no faster past that width). An
asynchronous trainer runs up to ceil(cells / max_cells_per_step) steps at once, each on
its own batch and each publishing a version when it ends; a sequential (synchronous)
trainer runs one step at a time. Staleness of a trained session = the version its step
started from minus the version of the session's first token.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-9


class FinishedQueue:
    """Finished trajectories waiting for a step, oldest first: first-token version and slot time."""

    def __init__(self) -> None:
        self._v0 = np.zeros(0, dtype=np.int64)
        self._dur = np.zeros(0)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.size = 0

    def push(self, v0: np.ndarray, dur: np.ndarray) -> None:
        if v0.size:
            self._chunks.append((v0, dur))
            self.size += int(v0.size)

    def _compact(self) -> None:
        if self._chunks:
            self._v0 = np.concatenate([self._v0, *(c[0] for c in self._chunks)])
            self._dur = np.concatenate([self._dur, *(c[1] for c in self._chunks)])
            self._chunks.clear()

    def purge(self, version: int, bound: int | None) -> tuple[int, float]:
        """Drop entries more than `bound` versions old; returns (count, their slot seconds)."""
        if bound is None or self.size == 0:
            return 0, 0.0
        self._compact()
        stale = (version - self._v0) > bound
        n = int(stale.sum())
        if n == 0:
            return 0, 0.0
        lost = float(self._dur[stale].sum())
        self._v0, self._dur = self._v0[~stale], self._dur[~stale]
        self.size -= n
        return n, lost

    def take(self, n: int) -> np.ndarray | None:
        """First-token versions of the `n` oldest entries, removed; None if fewer wait."""
        if self.size < n:
            return None
        self._compact()
        out = self._v0[:n]
        self._v0, self._dur = self._v0[n:], self._dur[n:]
        self.size -= n
        return out


class Trainer:
    """Fluid training steps over an elastic pool of cells. Mutates itself only."""

    def __init__(self, batch_size: int, step_cell_hours: float, max_cells_per_step: int,
                 staleness_bound: int | None, sequential: bool) -> None:
        self.batch_size = batch_size
        self.step_cell_s = step_cell_hours * 3600.0
        self.width = max_cells_per_step
        self.bound = staleness_bound
        self.sequential = sequential
        self.now = 0.0
        self.version = 0
        self.cells = 0
        self.steps: list[list] = []  # [remaining cell-seconds, staleness of its sessions]
        self.queue = FinishedQueue()
        self.trained_sessions = 0
        self.busy_cell_s = 0.0
        self.dropped = 0
        self.dropped_slot_s = 0.0
        self.staleness_hist = np.zeros(1, dtype=np.int64)
        self.step_end_times: list[float] = []

    # -- rates
    def max_steps(self) -> int:
        if self.cells <= 0:
            return 0
        return 1 if self.sequential else math.ceil(self.cells / self.width)

    def cells_per_step(self) -> float:
        k = len(self.steps)
        return min(float(self.width), self.cells / k) if k else 0.0

    def busy_cells(self) -> int:
        """Training cells doing useful work right now."""
        return int(min(self.cells, len(self.steps) * self.width))

    def next_completion(self) -> float:
        r = self.cells_per_step()
        if not self.steps or r <= 0:
            return math.inf
        return self.now + min(s[0] for s in self.steps) / r

    # -- time
    def _flow(self, t: float) -> None:
        dt = t - self.now
        if dt > 0 and self.steps:
            r = self.cells_per_step()
            for s in self.steps:
                s[0] -= r * dt
            self.busy_cell_s += r * len(self.steps) * dt
        self.now = max(self.now, t)

    def _complete_due(self) -> None:
        done = [s for s in self.steps if s[0] <= _EPS * self.step_cell_s]
        if not done:
            return
        self.steps = [s for s in self.steps if s[0] > _EPS * self.step_cell_s]
        for s in done:
            self.version += 1
            self.trained_sessions += self.batch_size
            self.step_end_times.append(self.now)
            self._count_staleness(s[1])
        n, lost = self.queue.purge(self.version, self.bound)
        self.dropped += n
        self.dropped_slot_s += lost
        self._try_start()

    def _try_start(self) -> None:
        while len(self.steps) < self.max_steps():
            v0 = self.queue.take(self.batch_size)
            if v0 is None:
                return
            self.steps.append([self.step_cell_s, self.version - v0])

    def run_until(self, t: float) -> None:
        """Advance to `t`, completing steps (and starting the next ones) on the way."""
        while True:
            tc = self.next_completion()
            if tc > t:
                self._flow(t)
                return
            self._flow(tc)
            self._complete_due()

    def set_cells(self, cells: int, t: float) -> None:
        self.run_until(t)
        self.cells = cells
        self._try_start()

    # -- arrivals
    def feed(self, times: np.ndarray, v0: np.ndarray, dur: np.ndarray) -> int:
        """Finished sessions in time order (all at or after `now`). Returns how many were
        accepted (not dropped for staleness). Steps start the moment a batch is complete."""
        accepted = 0
        i, n = 0, int(times.size)
        while i < n:
            tc = self.next_completion()
            j = int(np.searchsorted(times, tc, side="right"))
            if j <= i:  # a step ends before the next arrival
                self._flow(tc)
                self._complete_due()
                continue
            seg_v0 = v0[i:j]
            ok = np.ones(j - i, dtype=bool) if self.bound is None else (self.version - seg_v0) <= self.bound
            if len(self.steps) < self.max_steps():
                need = self.batch_size - self.queue.size
                pos = np.flatnonzero(ok)
                if pos.size >= need > 0:
                    m = int(pos[need - 1]) + 1  # the arrival that completes a batch
                    j, ok = i + m, ok[:m]
            self._accept(seg_v0[: j - i], dur[i:j], ok)
            accepted += int(ok.sum())
            if len(self.steps) < self.max_steps() and self.queue.size >= self.batch_size:
                self._flow(float(times[j - 1]))
                self._try_start()
            i = j
        return accepted

    def _accept(self, v0: np.ndarray, dur: np.ndarray, ok: np.ndarray) -> None:
        if ok.all():
            self.queue.push(v0.copy(), dur.copy())
            return
        self.dropped += int((~ok).sum())
        self.dropped_slot_s += float(dur[~ok].sum())
        self.queue.push(v0[ok], dur[ok])

    def _count_staleness(self, stale: np.ndarray) -> None:
        hist = np.bincount(stale, minlength=self.staleness_hist.size)
        if hist.size > self.staleness_hist.size:
            hist[: self.staleness_hist.size] += self.staleness_hist
            self.staleness_hist = hist
        else:
            self.staleness_hist += hist

    def trained_equivalent(self) -> float:
        """Sessions trained, counting the done share of steps still running."""
        running = sum(1.0 - s[0] / self.step_cell_s for s in self.steps)
        return self.trained_sessions + running * self.batch_size

    def mean_staleness(self) -> float:
        """Mean staleness (versions) of the sessions of completed steps."""
        total = int(self.staleness_hist.sum())
        if total == 0:
            return 0.0
        return float((np.arange(self.staleness_hist.size) * self.staleness_hist).sum() / total)

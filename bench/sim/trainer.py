"""The simulated trainer: a FIFO of finished trajectories and a fluid model of training steps.

One line: finished sessions queue -> a batch of `batch_size` fresh ones starts a step (one RL
update of the one RL job: all its minibatches) -> the step's work drains at the rate of the
cells it holds -> done: one published version.

Work is per token: a step's work is its sessions' tokens times `cell_s_per_token` (cell-seconds
at perfect scaling). Cells are elastic: a step on c cells (at most `width`) progresses at
c * eff(c) cell-seconds a second, eff(c) = efficiency ** (log2 c / log2 width) (strong
scaling: twice the cells, less than half the time). One step runs at a time, as in an RL
trainer that publishes one version per update, so a version is one update. Staleness of a
trained session = the version its step started from minus the version of its first token.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-9


class FinishedQueue:
    """Finished trajectories waiting for a step, oldest first: first-token version, slot
    time and tokens."""

    def __init__(self) -> None:
        self._v0 = np.zeros(0, dtype=np.int64)
        self._dur = np.zeros(0)
        self._tok = np.zeros(0)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.size = 0

    def push(self, v0: np.ndarray, dur: np.ndarray, tok: np.ndarray) -> None:
        if v0.size:
            self._chunks.append((v0, dur, tok))
            self.size += int(v0.size)

    def _compact(self) -> None:
        if self._chunks:
            self._v0 = np.concatenate([self._v0, *(c[0] for c in self._chunks)])
            self._dur = np.concatenate([self._dur, *(c[1] for c in self._chunks)])
            self._tok = np.concatenate([self._tok, *(c[2] for c in self._chunks)])
            self._chunks.clear()

    def purge(self, version: int, bound: int | None) -> tuple[int, float, float]:
        """Drop entries more than `bound` versions old; returns (count, slot seconds, tokens)."""
        if bound is None or self.size == 0:
            return 0, 0.0, 0.0
        self._compact()
        stale = (version - self._v0) > bound
        n = int(stale.sum())
        if n == 0:
            return 0, 0.0, 0.0
        lost, tok = float(self._dur[stale].sum()), float(self._tok[stale].sum())
        keep = ~stale
        self._v0, self._dur, self._tok = self._v0[keep], self._dur[keep], self._tok[keep]
        self.size -= n
        return n, lost, tok

    def take(self, n: int) -> tuple[np.ndarray, float, float] | None:
        """(first-token versions, slot seconds, tokens) of the `n` oldest entries, removed;
        None if fewer wait."""
        if self.size < n:
            return None
        self._compact()
        out = (self._v0[:n], float(self._dur[:n].sum()), float(self._tok[:n].sum()))
        self._v0, self._dur, self._tok = self._v0[n:], self._dur[n:], self._tok[n:]
        self.size -= n
        return out


class Step:
    """One running training step."""

    __slots__ = ("work", "total", "stale", "sessions", "slot_s", "tokens", "started", "cell_s")

    def __init__(self, work: float, stale: np.ndarray, slot_s: float, tokens: float, t: float) -> None:
        self.work = self.total = work
        self.stale = stale
        self.sessions = int(stale.size)
        self.slot_s = slot_s
        self.tokens = tokens
        self.started = t
        self.cell_s = 0.0


class Trainer:
    """Fluid training steps over an elastic pool of cells. Mutates itself only."""

    def __init__(self, batch_size: int, cell_s_per_token: float, width: int,
                 staleness_bound: int | None, efficiency: float = 1.0,
                 efficiency_width: int | None = None) -> None:
        self.batch_size = batch_size
        self.cell_s_per_token = cell_s_per_token
        self.width = width
        self.efficiency = efficiency
        self.efficiency_width = efficiency_width or width
        """The width at which the efficiency is `efficiency` (one curve for every policy)."""
        self.bound = staleness_bound
        self.now = 0.0
        self.version = 0
        self.cells = 0
        self.step: Step | None = None
        self.queue = FinishedQueue()
        self.trained_sessions = 0
        self.trained_tokens = 0.0
        self.trained_slot_s = 0.0
        self.busy_cell_s = 0.0
        self.dropped = 0
        self.dropped_slot_s = 0.0
        self.dropped_tokens = 0.0
        self.staleness_hist = np.zeros(1, dtype=np.int64)
        self.step_end_times: list[float] = []
        self.join_s = 0.0
        """Seconds a cell joining a running step takes before it trains."""
        self.debts: list[tuple[float, int]] = []
        """(until, cells): training cells still sending KV while no step runs; a step that
        starts before `until` has their remaining seconds to make up."""
        self.last_step: tuple[float, int, float, float] | None = None
        """(seconds, sessions, tokens, mean cells) of the last completed step: what a trainer reports."""

    @property
    def steps(self) -> list[Step]:
        return [] if self.step is None else [self.step]

    # -- rates
    def eff(self, c: float) -> float:
        if c <= 1.0 or self.efficiency_width <= 1 or self.efficiency >= 1.0:
            return 1.0
        return self.efficiency ** (math.log2(c) / math.log2(self.efficiency_width))

    def step_cells(self) -> float:
        return float(min(self.width, self.cells)) if self.step is not None else 0.0

    def busy_cells(self) -> int:
        """Training cells doing useful work right now."""
        return int(self.step_cells())

    def _rate(self) -> float:
        c = self.step_cells()
        return c * self.eff(c)

    def next_completion(self) -> float:
        r = self._rate()
        if self.step is None or r <= 0:
            return math.inf
        return self.now + self.step.work / r

    # -- time
    def _flow(self, t: float) -> None:
        dt = t - self.now
        if dt > 0 and self.step is not None:
            c = self.step_cells()
            self.step.work -= c * self.eff(c) * dt
            self.step.cell_s += c * dt
            self.busy_cell_s += c * dt
        self.now = max(self.now, t)

    def _complete_due(self) -> None:
        s = self.step
        if s is None or s.work > _EPS * max(1.0, s.total):
            return
        self.step = None
        self.version += 1
        self.trained_sessions += s.sessions
        self.trained_tokens += s.tokens
        self.trained_slot_s += s.slot_s
        self.step_end_times.append(self.now)
        dur = self.now - s.started
        self.last_step = (dur, s.sessions, s.tokens, s.cell_s / dur if dur > 0 else 0.0)
        self._count_staleness(s.stale)
        n, lost, tok = self.queue.purge(self.version, self.bound)
        self.dropped += n
        self.dropped_slot_s += lost
        self.dropped_tokens += tok
        self._try_start()

    def _try_start(self) -> None:
        if self.step is not None or self.cells <= 0:
            return
        got = self.queue.take(self.batch_size)
        if got is None:
            return
        v0, slot_s, tok = got
        self.step = Step(tok * self.cell_s_per_token, self.version - v0, slot_s, tok, self.now)
        late = sum(n * (until - self.now) for until, n in self.debts if until > self.now)
        self.debts.clear()
        self.delay(late)

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
        """The trainer holds `cells` from `t`. Cells joining a running step train only after
        `join_s` each (the step's work grows by what they would have done meanwhile)."""
        self.run_until(t)
        before = self.step_cells()
        self.cells = cells
        if self.step is not None and self.join_s > 0:
            self.delay(max(0.0, self.step_cells() - before) * self.join_s)
        self._try_start()

    def send_kv(self, seconds: float, cells: int) -> None:
        """`cells` training cells spend `seconds` each sending their sessions' KV from now: a
        running step has that much more to do; with none running, a step that starts before
        they are done waits for the rest (`debts`)."""
        if self.step is not None:
            self.delay(seconds * cells)
        elif seconds > 0 and cells > 0:
            self.debts.append((self.now + seconds, cells))

    def delay(self, cell_s: float) -> None:
        """Training cells arrive `cell_s` cell-seconds of work late (still sending KV, or
        joining): the running step has that much more to do."""
        if self.step is not None and cell_s > 0:
            c = self.step_cells()
            self.step.work += cell_s * self.eff(c)
            self.busy_cell_s -= cell_s  # those cell-seconds moved KV, they did not train
            self.step.cell_s -= cell_s

    # -- arrivals
    def feed(self, times: np.ndarray, v0: np.ndarray, dur: np.ndarray, tok: np.ndarray) -> int:
        """Finished sessions in time order (all at or after `now`). Returns how many were
        accepted (not dropped for staleness). A step starts the moment a batch is complete."""
        accepted = 0
        i, n = 0, int(times.size)
        while i < n:
            tc = self.next_completion()
            j = int(np.searchsorted(times, tc, side="right"))
            if j <= i:  # the step ends before the next arrival
                self._flow(tc)
                self._complete_due()
                continue
            seg_v0 = v0[i:j]
            ok = np.ones(j - i, dtype=bool) if self.bound is None else (self.version - seg_v0) <= self.bound
            if self.step is None and self.cells > 0:
                need = self.batch_size - self.queue.size
                pos = np.flatnonzero(ok)
                if pos.size >= need > 0:
                    m = int(pos[need - 1]) + 1  # the arrival that completes a batch
                    j, ok = i + m, ok[:m]
            self._accept(seg_v0[: j - i], dur[i:j], tok[i:j], ok)
            accepted += int(ok.sum())
            if self.step is None and self.cells > 0 and self.queue.size >= self.batch_size:
                self._flow(float(times[j - 1]))
                self._try_start()
            i = j
        return accepted

    def _accept(self, v0: np.ndarray, dur: np.ndarray, tok: np.ndarray, ok: np.ndarray) -> None:
        if ok.all():
            self.queue.push(v0.copy(), dur.copy(), tok.copy())
            return
        self.dropped += int((~ok).sum())
        self.dropped_slot_s += float(dur[~ok].sum())
        self.dropped_tokens += float(tok[~ok].sum())
        self.queue.push(v0[ok], dur[ok], tok[ok])

    def _count_staleness(self, stale: np.ndarray) -> None:
        hist = np.bincount(stale, minlength=self.staleness_hist.size)
        if hist.size > self.staleness_hist.size:
            hist[: self.staleness_hist.size] += self.staleness_hist
            self.staleness_hist = hist
        else:
            self.staleness_hist += hist

    def _running_share(self) -> float:
        s = self.step
        return 0.0 if s is None or s.total <= 0 else max(0.0, 1.0 - s.work / s.total)

    def trained_equivalent(self) -> float:
        """Sessions trained, counting the done share of the step still running."""
        s = self.step
        return self.trained_sessions + (self._running_share() * s.sessions if s else 0.0)

    def trained_tokens_equivalent(self) -> float:
        s = self.step
        return self.trained_tokens + (self._running_share() * s.tokens if s else 0.0)

    def trained_slot_s_equivalent(self) -> float:
        s = self.step
        return self.trained_slot_s + (self._running_share() * s.slot_s if s else 0.0)

    def mean_staleness(self) -> float:
        """Mean staleness (versions) of the sessions of completed steps."""
        total = int(self.staleness_hist.sum())
        if total == 0:
            return 0.0
        return float((np.arange(self.staleness_hist.size) * self.staleness_hist).sum() / total)

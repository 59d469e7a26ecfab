"""What the scheduler measures for the planner: finish rate, slot occupancy, training speed.

One line: every tick adds occupied and offered rollout slot-seconds -> every finished session
adds one finish -> every trainer report adds a step (seconds, sessions, tokens, cells) ->
`Rates` holds the moving averages the controller's `Snapshot` carries.

The averaging window is not an hour-scale constant: it is a few mean session slot times, and
the mean slot time is itself what the finish rate measures (slot-seconds per finish), so the
window follows minute-long and hour-long sessions alike. The cluster simulator measures the
same quantities the same way (bench/sim/run.py) from its own arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.store.jobs import DEFAULT_JOB

WINDOW_SESSIONS = 2.0
"""The finish-rate average spans about this many mean session slot times."""
MIN_WINDOW_S = 10.0
"""...and at least this long (a handful of ticks), so one tick's finishes do not swing it."""
STEP_WEIGHT = 0.5
"""Weight of the newest step in the training-speed averages (steps are few and informative)."""
NEW_WINDOW_SESSIONS = 1.0 / 12.0
"""Sessions started within this many mean slot times are "new": their token rate says how long
the sessions starting now will hold a slot (10 minutes at 2 h sessions)."""
TREND_SESSIONS = 0.25
"""The trend of the new sessions' rate is averaged over about this many mean slot times."""
SWING_FACTOR = 1.2
"""A turn of the new sessions' rate counts once it has moved back this factor off its extreme
(smaller moves are noise; measured swings on the simulator's shapes are 2-3x)."""
SWING_TURNS = 5
"""The period and the swing are the medians over this many last turns."""


class Swings:
    """The new sessions' rate as a wave: its turning points (a peak or a trough, counted once
    the rate has moved back `SWING_FACTOR` off it) -> `period_s` (twice the median time between
    turns) and `swing` (the median ratio of one extreme to the next). Both 0 = unknown: fewer
    than three turns, or none for longer than a period (the wave has stopped)."""

    def __init__(self) -> None:
        self._dir = 0
        self._ext = 0.0
        self._ext_at = 0.0
        self._turns: list[tuple[float, float]] = []
        self._now = 0.0

    def on_rate(self, t: float, rate: float) -> None:
        self._now = t
        if self._ext <= 0.0:
            self._ext, self._ext_at = rate, t
            return
        if self._dir > 0 and rate > self._ext or self._dir < 0 and rate < self._ext:
            self._ext, self._ext_at = rate, t  # the extreme moves on (before the first move: the start)
        if self._dir >= 0 and rate * SWING_FACTOR < self._ext:
            self._turn(-1, t, rate)
        elif self._dir <= 0 and rate > self._ext * SWING_FACTOR:
            self._turn(1, t, rate)

    def _turn(self, to: int, t: float, rate: float) -> None:
        if self._dir != 0:  # the first move only sets the direction
            self._turns = [*self._turns, (self._ext_at, self._ext)][-(SWING_TURNS + 1):]
        self._dir, self._ext, self._ext_at = to, rate, t

    def period_s(self) -> float:
        if len(self._turns) < 3:
            return 0.0
        gaps = sorted(b[0] - a[0] for a, b in zip(self._turns, self._turns[1:]))
        period = 2.0 * gaps[len(gaps) // 2]
        return period if self._now - self._turns[-1][0] <= period else 0.0

    def swing(self) -> float:
        if self.period_s() <= 0.0:
            return 0.0
        ratios = sorted(max(a[1], b[1]) / min(a[1], b[1]) for a, b in zip(self._turns, self._turns[1:]))
        return ratios[len(ratios) // 2]


@dataclass(slots=True)
class TrainerDemand:
    """What the trainer declared in its latest report (POST /v1/trainer/report)."""

    batch_size: int
    """Sessions one training step consumes."""
    steps_in_progress: int
    """Training steps running now."""
    max_cells_per_step: int
    """Cells one step can use."""
    max_concurrent_steps: int = 1
    untrained: int = 0
    """Sessions the trainer fetched and has not trained yet."""


class Rates:
    """Moving averages of what the control loop observes. Mutated only by its own methods."""

    def __init__(self) -> None:
        self.finishes = 0.0
        """Decayed count of finished sessions."""
        self.occupied_slot_s = 0.0
        """Decayed occupied rollout slot-seconds."""
        self.offered_slot_s = 0.0
        """Decayed rollout slot-seconds (occupied or not)."""
        self._pending_finishes = 0
        self.finished_tokens = 0.0
        """Decayed tokens of the finished sessions (with `finishes`: tokens a session)."""
        self._pending_tokens = 0.0
        self.new_session_rate_per_slot_s = 0.0
        """1 / the expected slot time of the sessions started lately (`on_new_sessions`); 0 = unknown."""
        self.new_session_rate_trend = 0.0
        """Its change a second (averaged over `TREND_SESSIONS` mean slot times)."""
        self._new_at: float | None = None
        self.new_session_swings = Swings()
        """The new sessions' rate as a wave: its period and swing (`Snapshot.new_session_rate_period_s`)."""
        self.train_rate_per_cell_s = 0.0
        self.train_step_s = 0.0
        self.tokens_per_step = 0
        self.demand: TrainerDemand | None = None
        self.by_job: dict[str, Rates] = {}
        """RL job → its own rates (its trainer's reports; its cells' slots and finishes), on a
        fleet shared by several jobs (docs/JOBS.md). The implicit job's trainer reports here."""

    def trainer(self, job: str | None) -> Rates:
        """The rates a trainer of `job` reports into: these for the implicit job (or a trainer
        bound to none), else the job's own."""
        if job is None or job == DEFAULT_JOB:
            return self
        return self.job(job)

    def job(self, job: str) -> Rates:
        """`job`'s own rates (made on first use)."""
        out = self.by_job.get(job)
        if out is None:
            out = self.by_job[job] = Rates()
        return out

    # -- rollout side
    def on_finish(self, n: int = 1, tokens: float = 0.0) -> None:
        """Sessions finished since the last tick, and their tokens (counted at the next `on_tick`)."""
        self._pending_finishes += n
        self._pending_tokens += tokens

    def new_window_s(self) -> float:
        """Sessions started this recently count as new (`NEW_WINDOW_SESSIONS`)."""
        return max(MIN_WINDOW_S, NEW_WINDOW_SESSIONS * self.mean_slot_s())

    def tokens_per_session(self) -> float:
        return self.finished_tokens / self.finishes if self.finishes > 0 else 0.0

    def on_new_sessions(self, t: float, tokens_per_s: float, n: int) -> None:
        """The `n` sessions started within `new_window_s` and decoding now hold `tokens_per_s`
        tokens a second together: a session holds its slot about (tokens a session) / (its
        token rate), so their mean rate over the tokens a finished session holds is the finish
        rate a slot will have on them. Kept while fewer than one start (nothing new measured)."""
        per_session = self.tokens_per_session()
        if n <= 0 or tokens_per_s <= 0 or per_session <= 0:
            return
        rate = tokens_per_s / n / per_session
        if self._new_at is not None and t > self._new_at and self.new_session_rate_per_slot_s > 0:
            tau = max(MIN_WINDOW_S, TREND_SESSIONS * self.mean_slot_s())
            w = 1.0 - math.exp(-(t - self._new_at) / tau)
            slope = (rate - self.new_session_rate_per_slot_s) / (t - self._new_at)
            self.new_session_rate_trend = (1.0 - w) * self.new_session_rate_trend + w * slope
        self.new_session_rate_per_slot_s, self._new_at = rate, t
        self.new_session_swings.on_rate(t, rate)

    def on_tick(self, dt: float, occupied_slots: int, offered_slots: int) -> None:
        """Fold one tick of `dt` seconds in: the slots occupied and offered over it, and the
        finishes since the last tick. O(1)."""
        if dt <= 0:
            return
        mean_slot_s = self.mean_slot_s()
        window = max(MIN_WINDOW_S, WINDOW_SESSIONS * mean_slot_s) if mean_slot_s > 0 else 3600.0
        keep = math.exp(-dt / window)
        self.finishes = keep * self.finishes + self._pending_finishes
        self.finished_tokens = keep * self.finished_tokens + self._pending_tokens
        self.occupied_slot_s = keep * self.occupied_slot_s + occupied_slots * dt
        self.offered_slot_s = keep * self.offered_slot_s + offered_slots * dt
        self._pending_finishes = 0
        self._pending_tokens = 0.0

    def finish_rate_per_slot_s(self) -> float:
        """Finished sessions per occupied rollout slot-second; 0 = none measured yet."""
        return self.finishes / self.occupied_slot_s if self.finishes > 0 and self.occupied_slot_s > 0 else 0.0

    def mean_slot_s(self) -> float:
        """Mean slot time of a session (the inverse of the finish rate); 0 = unknown."""
        r = self.finish_rate_per_slot_s()
        return 1.0 / r if r > 0 else 0.0

    def slot_occupancy(self) -> float:
        return self.occupied_slot_s / self.offered_slot_s if self.offered_slot_s > 0 else 1.0

    # -- training side
    def on_trainer_report(self, demand: TrainerDemand, step_s: float | None = None,
                          sessions: int | None = None, tokens: int | None = None,
                          cells: int | None = None) -> None:
        """The trainer's demand, and the step it just finished if any."""
        self.demand = demand
        if step_s and sessions and cells:
            rate = sessions / (step_s * cells)
            w = STEP_WEIGHT if self.train_rate_per_cell_s > 0 else 1.0
            self.train_rate_per_cell_s = (1 - w) * self.train_rate_per_cell_s + w * rate
            self.train_step_s = (1 - w) * self.train_step_s + w * step_s
            self.tokens_per_step = int(tokens or 0)

"""A seeded fault campaign over a real local cluster (scheduler + 3 cells + a trainer-side
version host), with a history of every operation and invariant checks over it.

One run: make the cluster healthy (restart what a previous fault killed, flip cells back to
rollout, every cell on the current version, every token scored) → arm the victim (restart it
with its failpoints) → start streamed completions → trigger (a flip, a publish, a signal) →
the fault fires (observed: a process that died by SIGKILL, one seen stopped, a failpoint's
message in its log, a signal delivered) → react as an operator would (restart the killed
process, SIGCONT the zombie after its lease) → every request ends → check I1–I5 (checker.py).
A store sampler reads the SQLite store (read-only) every `SAMPLE_S` throughout, feeding the
I2/I3 checks and the recovery times: recovery = from the fault until every request unfinished
at the fault commits a token again (or ends); healthy = from the fault until the next run may
start.

Scenarios (SCENARIOS): migration faults at every migration failpoint on the source and the
destination (SIGKILL, raise), a partition inside a KV transfer (`block`), a zombie cell
(SIGSTOP past its lease, SIGCONT), a zombie destination stopped right after its commit, the
scheduler SIGKILLed between recording a flip and acting on it and at every migration failpoint
(then restarted: I5), the trainer SIGKILLed mid-broadcast, a receiver killed or stalled
mid-bucket, and a cell killed or failing during the log-prob scoring pass.

The canary (`canary=True`) restarts the scheduler with the test-only switch
CELLFLIP_CANARY_NO_FENCING=1 (scheduler/contract/failpoints.py) and runs the fencing-sensitive
scenarios again; the checkers must report violations there.
"""

from __future__ import annotations

import random
import time

from faultkit import checker
from faultkit.runs import Run, client_recoveries
from faultkit.scenarios import SCENARIOS
from faultkit.settings import Hang
from faultkit.verdicts import Verdicts


class Campaign(Verdicts):
    """Runs scenarios one after another on one cluster, each made healthy first."""

    # -- one run ----------------------------------------------------------------------------
    def run_one(self, name: str, index: int, seed: int, k: int, canary: bool = False) -> Run:
        run = Run(name, index, seed, canary=canary, rng=random.Random(seed))
        ref = self.history.invoke("campaign", "run", scenario=name, index=index, seed=seed, canary=canary)
        t_start = time.monotonic()
        try:
            self.healthy(run)
        except Hang as e:
            run.hangs.append(f"before the run: {e}")
            self.hard_reset()
            self.healthy(run)
        with self._lock:
            self.run = run
        run.t0 = time.monotonic()
        run.mig_log_offset = self.mig_log.stat().st_size if self.mig_log.exists() else 0
        run.sync_log_offset = self.sync_log.stat().st_size if self.sync_log.exists() else 0
        stalls_before = self.stall_count()
        try:
            SCENARIOS[name](self, run, k)
            self.settle(run)
        except Hang as e:
            run.hangs.append(str(e))
            self.log(f"  HANG in {name}: {e}")
        except Exception as e:  # a campaign bug, not a system fault: record it loudly
            run.hangs.append(f"campaign error: {e!r}")
            self.log(f"  ERROR in {name}: {e!r}")
        try:
            self.check(run)
        except Exception as e:  # a checker that crashes checked nothing: the run fails
            run.checker_errors.append(f"check: {e!r}")
            self.log(f"  CHECK ERROR in {name}: {e!r}")
        self.note_exits(run)
        run.stalls = self.stall_count() - stalls_before
        if run.stalls:
            run.notes.append(f"the stall watchdog re-placed {run.stalls} requests (cell logs: 'no token for')")
            self.log(f"  {run.notes[-1]}")
        try:
            self.healthy(run)
            run.t_healthy = time.monotonic()
        except Hang as e:
            run.hangs.append(f"recovery: {e}")
            self.log(f"  HANG recovering after {name}: {e}")
            self.hard_reset()
        with self._lock:
            self.run = None
        if run.t_fault is not None:
            run.recovery_s = checker.recovery_s(run.samples, run.t_fault,
                                                [c.stream.request_id for c in run.clients if c.stream.request_id])
            if run.recovery_s is None and not run.hangs:
                run.hangs.append("a request made no progress after the fault within the run")
            run.recoveries = client_recoveries(run)
        self.history.ok(ref, **{k: v for k, v in run.summary().items() if k not in ("scenario", "index", "seed")},
                        wall_s=time.monotonic() - t_start)
        self.runs.append(run)
        return run

    # -- the whole campaign -----------------------------------------------------------------
    def plan(self, runs: int, names: list[str] | None = None) -> list[tuple[str, int]]:
        """Round-robin over the scenarios in a seeded order; (name, k) with k the run's index
        within its scenario (it picks the failpoint / variant)."""
        names = list(names or SCENARIOS)
        rng = random.Random(self.seed)
        out, counts = [], dict.fromkeys(names, 0)
        while len(out) < runs:
            batch = names[:]
            rng.shuffle(batch)
            for n in batch[: runs - len(out)]:
                out.append((n, counts[n]))
                counts[n] += 1
        return out

    def execute(self, plan: list[tuple[str, int]], canary: bool = False,
                deadline: float | None = None) -> list[Run]:
        done = []
        if canary:
            self.nem.scheduler_env = {"CELLFLIP_CANARY_NO_FENCING": "1"}
            self.nem.restart_scheduler()
        try:
            for name, k in plan:
                if deadline is not None and time.monotonic() > deadline:
                    self.log(f"  time budget spent: {len(plan) - len(done)} runs left out")
                    break
                seed = random.Random(f"{self.seed}/{len(self.runs)}/{name}").randrange(1 << 31)
                t = time.monotonic()
                run = self.run_one(name, len(self.runs), seed, k, canary=canary)
                done.append(run)
                self.log(f"[{run.index:3d}] {'canary ' if canary else ''}{name:26s} k={k} "
                         f"{time.monotonic() - t:5.1f}s faults={len(run.faults)} "
                         f"recovery={max(run.recoveries) if run.recoveries else '-'} "
                         f"failed={run.failed} stream_errors={run.stream_errors} reconnects={run.reconnects} "
                         f"violations={len(run.violations)} lost={run.lost} hangs={len(run.hangs)} exits={len(run.exits)}"
                         + (f" {run.params}" if run.params else ""))
                for v in run.violations[:3] + run.hangs[:2]:
                    self.log(f"        {v[:300]}")
        finally:
            if canary:
                self.nem.scheduler_env = {}
                self.nem.restart_scheduler()
        return done

"""One run of a scenario and what its clients felt; the campaign's summary over runs."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from cells.localcluster import Streamer
from faultkit import checker
from faultkit.celllogs import CELL_LOGS


# -- runs ------------------------------------------------------------------------------------
@dataclass
class Client:
    stream: Streamer
    process: str
    ref: int
    """History index of its invoke."""


@dataclass
class Run:
    scenario: str
    index: int
    seed: int
    canary: bool = False
    params: dict = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    clients: list[Client] = field(default_factory=list)
    flips: list[str] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    t0: float = 0.0
    t_fault: float | None = None
    t_healthy: float | None = None
    violations: list[str] = field(default_factory=list)
    checker_errors: list[str] = field(default_factory=list)
    """A checker that raised: it checked nothing, so the run fails (never a silent pass)."""
    lost: int = 0
    hangs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    recovery_s: float | None = None
    mig_log_offset: int = 0
    sync_log_offset: int = 0
    exits: list[str] = field(default_factory=list)
    """Processes that died on their own (not by a fault of the nemesis): crashes."""
    stalls: int = 0
    """Requests the scheduler's stall watchdog took back from a cell that held them undecoded."""
    failed: int = 0
    """Accepted requests that ended `failed` (a client sees an error finish)."""
    stream_errors: int = 0
    """Clients whose stream broke and could not be followed again under its Idempotency-Key."""
    reconnects: int = 0
    """Follows after a broken stream (a real client's reconnect; not a loss when it completes)."""
    unfired: int = 0
    """Faults the scenario armed that never fired: the run tested nothing of them."""
    recoveries: list[float] = field(default_factory=list)
    """Per request unfinished at the fault: seconds from the fault to its client's next token
    (or its finish)."""

    def summary(self) -> dict:
        return {"scenario": self.scenario, "index": self.index, "seed": self.seed, "canary": self.canary,
                "params": self.params, "faults": self.faults, "violations": self.violations, "lost": self.lost,
                "hangs": self.hangs, "notes": self.notes, "exits": self.exits, "stalls": self.stalls,
                "checker_errors": self.checker_errors, "failed": self.failed, "stream_errors": self.stream_errors,
                "reconnects": self.reconnects, "unfired": self.unfired, "recoveries": self.recoveries,
                "recovery_s": self.recovery_s,
                "healthy_s": None if self.t_healthy is None or self.t_fault is None else self.t_healthy - self.t_fault,
                "requests": [c.stream.request_id for c in self.clients]}



def client_recoveries(run: Run, in_flight_s: float = 0.3) -> list[float]:
    """For each request its client had not finished at the fault: seconds from the fault until
    its client got the next token (or its finish) — what the client felt, reconnects
    included. Tokens arriving within `in_flight_s` were sampled before the fault (one sync)
    and do not count as recovery. A request that got nothing more counts as the whole run."""
    t_fault = run.t_fault
    out = []
    for c in run.clients:
        s = c.stream
        if s.request_id is None or (s.finished_at is not None and s.finished_at <= t_fault) or not s.times:
            continue
        if s.times[0] > t_fault:
            continue  # started after the fault: not affected by it
        after = [t for t in s.times if t > t_fault + in_flight_s]
        ends = [t for t in (after[0] if after else None, s.finished_at) if t is not None and t > t_fault]
        out.append(round(min(ends) - t_fault, 3) if ends else round(time.monotonic() - t_fault, 3))
    return out


def summarize(runs: list[Run], canary_runs: list[Run]) -> dict:
    by: dict[str, dict] = {}
    recoveries: dict[str, list[float]] = {}
    for r in runs:
        b = by.setdefault(r.scenario, {"runs": 0, "faults_fired": 0, "unfired_faults": 0, "invariant_violations": 0,
                                       "lost_requests": 0, "failed_requests": 0, "stream_errors": 0,
                                       "client_reconnects": 0, "hangs": 0, "unexpected_exits": 0,
                                       "stalled_requests": 0, "affected_requests": 0, "max_healthy_s": 0.0,
                                       "checker_errors": 0, "params": [], "violations": []})
        b["runs"] += 1
        b["faults_fired"] += len(r.faults)
        b["unfired_faults"] += r.unfired
        b["invariant_violations"] += len(r.violations)
        b["lost_requests"] += r.lost
        b["failed_requests"] += r.failed
        b["stream_errors"] += r.stream_errors
        b["client_reconnects"] += r.reconnects
        b["hangs"] += bool(r.hangs)
        b["unexpected_exits"] += len(r.exits)
        b["stalled_requests"] += r.stalls
        b["checker_errors"] += len(r.checker_errors)
        recoveries.setdefault(r.scenario, []).extend(r.recoveries)
        healthy = r.summary()["healthy_s"]
        if healthy is not None:
            b["max_healthy_s"] = max(b["max_healthy_s"], healthy)
        if r.params and r.params not in b["params"]:
            b["params"].append(r.params)
        b["violations"] += [v for v in r.violations + r.hangs + r.exits + r.checker_errors
                            if v not in b["violations"]][:5]
    for name, b in by.items():
        rec = sorted(recoveries[name])
        b["affected_requests"] = len(rec)
        if rec:
            b["recovery_p50_s"] = rec[len(rec) // 2]
            b["recovery_max_s"] = rec[-1]
        else:  # nothing to recover: say so rather than report 0.0
            b["recovery_p50_s"] = b["recovery_max_s"] = None
            b["recovery"] = "no request in flight at any fault"
        b["max_healthy_s"] = round(b["max_healthy_s"], 3)
        b["violations"] = b["violations"][:5]
    canary_vio = [v for r in canary_runs for v in r.violations]
    every = [x for r in runs for x in r.recoveries]
    return {
        "scenarios": len(by),
        "runs": len(runs),
        "faults_fired": sum(len(r.faults) for r in runs),
        "unfired_faults": sum(r.unfired for r in runs),
        "invariant_violations": sum(len(r.violations) for r in runs),
        "lost_requests": sum(r.lost for r in runs),
        "failed_requests": sum(r.failed for r in runs),
        "stream_errors": sum(r.stream_errors for r in runs),
        "client_reconnects": sum(r.reconnects for r in runs),
        "hangs": sum(bool(r.hangs) for r in runs),
        "unexpected_exits": sum(len(r.exits) for r in runs),
        "stalled_requests": sum(r.stalls for r in runs),
        "affected_requests": len(every),
        "recovery_p50_s": sorted(every)[len(every) // 2] if every else None,
        "max_recovery_s": max(every) if every else None,
        "checker_errors": sum(len(r.checker_errors) for r in runs + canary_runs),
        "canary_violations": len(canary_vio),
        "canary_store_violations": sum(checker.STORE_HISTORY in v for v in canary_vio),
        "client_violations": sum(v.startswith(checker.CLIENT_VS_TRAINER) for r in runs for v in r.violations),
        "canary_client_violations": sum(v.startswith(checker.CLIENT_VS_TRAINER) for v in canary_vio),
        "cell_log_violations": sum(CELL_LOGS in v for r in runs for v in r.violations),
        "canary_cell_log_violations": sum(CELL_LOGS in v for v in canary_vio),
        "canary_independent_violations": sum(v.startswith(checker.CLIENT_VS_TRAINER) or CELL_LOGS in v
                                             for v in canary_vio),
        "canary_runs": len(canary_runs),
        "canary_faults_fired": sum(len(r.faults) for r in canary_runs),
        "canary_examples": sorted(set(canary_vio))[:5],
        "by_scenario": dict(sorted(by.items())),
    }

"""Fault campaign (Jepsen style): a seeded run of every fault scenario against a real local
cluster, a history of every operation, invariants I1–I5 checked over it, then a canary run.

One started cluster (a scheduler with its SQLite store, 3 cells of the tiny preset in
batch-invariant mode, a trainer-side version host) serves every run; a process a fault kills
is restarted (a cell as a new incarnation, the scheduler on the same store, the trainer as the
next version). Scenarios, their runs round-robin in a seeded order (faultkit/scenarios/):
  mig_kill_source / mig_kill_destination  SIGKILL of the migration's source (after a copy round,
      before / after the stop-and-copy, before it frees) or destination (inside the transfer,
      before / after its commit); restarted at once or after its lease
  mig_raise                 `raise` at each of those seven failpoints
  partition_transfer        `block` inside the destination's KV transfer: no bytes flow until
                            the source's own timeout fires
  zombie_cell               SIGSTOP of a cell with requests past its lease, then SIGCONT
  zombie_destination        the destination stops itself right after its commit (SIGCONT after
                            the lease and the source's transfer timeout)
  scheduler_kill_flip       scheduler SIGKILLed between recording a flip and acting on it
  scheduler_kill_migration  scheduler SIGKILLed while a cell is held at a migration failpoint
  trainer_kill_broadcast    the trainer process dies mid-bucket of a broadcast
  broadcast_receiver        a receiving cell dies, or stalls past the op timeout, mid-bucket
  scoring_fault             a cell dies, or its scorer fails, at a scoring task of the final pass
  training_rank_fault       a training cell dies (SIGKILL) or stalls (SIGSTOP) mid-update; the
                            step is redone by the other training cell; invariant: its parameters
                            equal a fault-free update of the same batch (relative difference
                            <= 1e-3) and one version number is taken, after the redo

Fields of the JSON line:
- scenarios, runs: counts of distinct scenarios and of runs (canary runs not included).
- faults_fired: faults that demonstrably happened: a failpoint reached (its process died by
  SIGKILL, was seen stopped, or logged the failpoint's error), a signal delivered, a broadcast
  that had to retry around a stalled receiver.
- invariant_violations: violations of I1–I5 found by faultkit/checker.py over the history
  and the store snapshots (sampled every 0.1 s, read-only): I1 every accepted request ends
  finished or failed-with-reason, no token doubled or dropped between cell, store and client,
  token-exact against a fault-free run where one version served it; I2 one owner per request
  at every snapshot and as the cells acted (never source and destination both continuing); I3 no
  version retired while a token of it lacks an old log-prob; I4 no cell serves and no token
  carries a version not completely delivered; I5 a restarted scheduler extends the last
  committed state (flips, versions, token buffers, requests).
- faults_fired / unfired_faults: a fault a scenario armed that never fired tested nothing:
  any unfired fault fails the run.
- lost_requests: what a client feels as a loss: accepted requests that never reached a
  terminal state, that ended `failed` (`failed_requests`, also on its own), or whose client's
  stream broke and could not be followed again (`stream_errors`, on its own too). Clients are
  written as a real one is: each request carries an Idempotency-Key and a broken stream (a
  scheduler restart) is followed again from its first token, the tokens already received
  skipped (`client_reconnects` counts those follows; a replay that disagrees with what the
  client first got is an I1 violation).
- stalled_requests: requests the scheduler's stall watchdog (`stall_timeout_s`, 15 s here) took
  back from a cell that kept reporting them without committing a token, and re-placed; each is
  a liveness defect the watchdog recovered from, named in the run's notes.
- unexpected_exits: processes that died on their own (not by the nemesis).
- hangs: runs in which a bounded wait ran out (a request, a flip, or the recovery to healthy).
- affected_requests, recovery_p50_s, max_recovery_s: per request its client had not finished
  at the fault, seconds from the fault until that client got its next token (or its finish),
  reconnects included: p50 and max over all runs, and per scenario in by_scenario
  (`recovery_p50_s`, `recovery_max_s`; a scenario where no request was in flight at any fault
  says so in `recovery` instead of reporting 0), with max_healthy_s: until the whole cluster
  is healthy again, restarts and catch-ups included.
- checker_errors: checks that raised (main and canary runs); a crashed checker fails the run.
- canary_violations: violations the same checkers report in the canary runs, where the
  scheduler runs with the test-only CELLFLIP_CANARY_NO_FENCING=1 (scheduler/contract/failpoints.py:
  a source's abort after the destination's commit won is accepted, fenced parties are not
  refused, and token batches from a non-owner or at a stale epoch are stored) over the
  fencing-sensitive scenarios. Must be > 0: the checkers can fail.
- canary_store_violations: those of them found in the store's own token history (a sampled
  token stored at an epoch a committed migration had superseded, or any token batch taken
  from a cell that was not the owner at its epoch), not in the cells' logs. Must be > 0: with
  the fence off a zombie's tokens reach the store (a destination stopped after its commit, a
  cell stopped past its lease, each waking to sync what it decoded), and the store's history
  alone must show it. Whether a zombie wakes inside that window depends on timing: after the
  canary's rounds, its scenarios run once more at most, one by one, until the store shows one.
- client_violations / canary_client_violations: violations found by comparing the tokens each
  client received with the session the trainer is handed (GET /v1/sessions/{id}: the prompt,
  then exactly the client's tokens, each sampled): a gap, a duplicate or a foreign token; this
  check reads nothing of the store's own bookkeeping (rows, epochs, its token history). 0 in
  the main runs. In the canary it finds nothing as a rule, and that is a finding: sampling is
  seeded and batch-invariant, so a zombie's tokens equal its successor's, and the store takes no
  token that differs from the one already at its index — the clients and the trainer see the
  same tokens even with the fence off.
- cell_log_violations / canary_cell_log_violations: ownership as the cells saw it: each cell
  logs the batches the scheduler took from it (CELLFLIP_SYNC_LOG) with their send time; a
  batch of an older epoch taken though sent after one of a newer epoch, or two cells taken at
  one epoch, is split ownership (faultkit/celllogs.py); so is a migration whose source resumed
  while its destination committed, by the two cells' migration logs alone (checker.py).
  canary_independent_violations: the canary's catches by the checks independent of the store's
  bookkeeping (the cells' own logs, the clients against the trainer; the target: >= 1).
- canary_runs: canary runs made (rounds, plus the ones run until the store showed a split).

Exit status (the targets of bench/targets.yaml, judged by `finish`): 1 on any violation, lost
request, unfired fault, hang, unexpected exit or checker error outside the canary, or a canary
that no checker caught or that the store's history did not show (a run without the canary,
--canary-rounds 0, misses those two: explore with --no-targets).
- requests: completions started over the main runs; history: the JSON-lines history file.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import finish, parse_args, set_threads

from faultkit.campaign import Campaign
from faultkit.checker import STORE_HISTORY
from faultkit.runs import summarize
from faultkit.scenarios import CANARY_PLAN


def _extra(ap) -> None:
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, help="main runs (default 55 with --quick, else 110)")
    ap.add_argument("--canary-rounds", type=int, help="rounds of the canary plan (default 1 with --quick, else 2)")
    ap.add_argument("--workdir", help="where the cluster, its logs and the history go (default: a temp dir)")


def main() -> None:
    args = parse_args(__doc__, _extra)
    set_threads(1)
    runs = args.runs or (55 if args.quick else 110)
    rounds = args.canary_rounds if args.canary_rounds is not None else (1 if args.quick else 2)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cellflip-faults-"))
    print(f"work dir {workdir}", flush=True)
    t0 = time.monotonic()
    camp = Campaign(workdir, seed=args.seed, log=lambda m: print(m, flush=True))
    try:
        main_runs = camp.execute(camp.plan(runs))
        canary_runs = camp.execute(CANARY_PLAN * rounds, canary=True) if rounds else []
        # whether a zombie wakes inside the window that splits ownership depends on timing: as
        # the test does, one more round at most, scenario by scenario, until the store shows it
        for entry in CANARY_PLAN if rounds else []:
            if any(STORE_HISTORY in v for r in canary_runs for v in r.violations):
                break
            canary_runs += camp.execute([entry], canary=True)
    finally:
        camp.close()
    result = summarize(main_runs, canary_runs)
    result["requests"] = sum(len(r.clients) for r in main_runs)
    result["seed"] = args.seed
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["history"] = str(workdir / "history.jsonl")
    finish(result, args, "faults")


if __name__ == "__main__":
    main()

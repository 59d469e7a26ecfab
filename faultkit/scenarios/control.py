"""Faults of the control plane and weight traffic: the scheduler, the trainer, receivers, scoring."""

from __future__ import annotations

import signal
import time

from cells.transport.broadcast import SETTLE_EXTRA_S
from faultkit.runs import Run
from faultkit.scenarios.common import _migration_setup
from faultkit.settings import (
    ALL_FPS,
    BUCKET_BYTES,
    CELLS,
    HEALTHY_DEADLINE_S,
    SRC_FPS,
    TRANSFER_TIMEOUT_S,
    Hang,
)
from faultkit.verdicts import Verdicts


def scn_scheduler_kill_flip(camp: Verdicts, run: Run, k: int) -> None:
    """The scheduler dies between recording a flip and acting on it; restarted, it carries
    the flip out (or rolls it back) exactly once, having lost nothing committed."""
    camp.nem.restart_scheduler({"flip.after_record": "1*kill"})
    camp.wait(lambda: all(c["state"] == "rollout" for c in camp.cells().values()), HEALTHY_DEADLINE_S,
              "cells re-synced")
    camp.start_clients(run, 3)
    owners = camp.owners(run)
    victim = run.rng.choice(sorted(owners) or ["cell-0"])
    run.params["cell"] = victim
    old = set(camp.snapshot()["flips"])
    camp.post_flip(run, victim, "training")  # the scheduler dies inside this call
    if not camp.await_fault(run, lambda: camp.nem.killed("scheduler"), 10, "SIGKILL", "scheduler",
                            failpoint="flip.after_record"):
        return
    before = camp.committed_state(run)
    recorded = [f for f in before["flips"] if f not in old]
    if not recorded:
        run.violations.append(f"I5: the flip of {victim} was not recorded before the scheduler died")
    camp.nem.restart_scheduler()
    camp.check_restart(run, before)
    run.flips += [f for f in recorded if f not in run.flips]


def scn_scheduler_kill_migration(camp: Verdicts, run: Run, k: int) -> None:
    """A cell stops itself at a migration failpoint; the scheduler is SIGKILLed there and
    restarted; the cell continues: the migration ends exactly once (I5, I2)."""
    fps = [f for f in ALL_FPS if f != "migrate.transfer"]
    fp = fps[k % len(fps)]
    run.params["failpoint"] = fp
    side = "S" if fp in SRC_FPS else "D"
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*stop"}})
    victim = S if side == "S" else D
    if not camp.await_fault(run, lambda: camp.nem.stopped(victim), 30, "SIGSTOP", victim, failpoint=fp):
        return
    if camp.nem.signal("scheduler", signal.SIGKILL, f"at {fp}"):
        camp.fault(run, "SIGKILL", "scheduler", failpoint=fp)
    before = camp.committed_state(run)  # the store as the dead scheduler left it
    camp.nem.restart_scheduler(wait_ready=False)  # the stopped cell must be back within the grace
    camp.nem.signal(victim, signal.SIGCONT, "resume after the scheduler restart")
    camp.nem.wait_ready()
    camp.check_restart(run, before)


def scn_trainer_kill_broadcast(camp: Verdicts, run: Run, k: int) -> None:
    """The trainer dies mid-broadcast: no cell may serve the half-sent version; the restarted
    trainer publishes the next version and every cell moves to it."""
    v = camp.next_version
    camp.next_version += 2
    run.params["version"] = v
    p = camp.nem.start_trainer(v, {"broadcast.mid_bucket": "2*kill"}, BUCKET_BYTES, TRANSFER_TIMEOUT_S)
    camp.partial.add(v)
    camp.wait(lambda: p.poll() is not None or f'"ready": {p.pid}' in (camp.cluster.tmp / "trainer.log").read_text(),
              60, "the trainer holds its version")
    camp.start_clients(run, 3)
    camp.nem.go_trainer(p)
    camp.wait(lambda: p.poll() is not None, 60, "the trainer dies mid-broadcast")
    if p.returncode == -signal.SIGKILL:
        camp.fault(run, "SIGKILL", "trainer", failpoint="broadcast.mid_bucket", version=v)
        time.sleep(run.rng.uniform(0.0, 1.0))  # the receivers notice on their own timeouts
        t = camp.publish(v + 1)  # the restarted trainer publishes its next version
        t.join(60)
        if t.is_alive():
            raise Hang(f"broadcast of version {v + 1} after the trainer restart")
    else:
        run.notes.append(f"the trainer exited with {p.returncode}, see trainer.log")
        camp.partial.discard(v)


def scn_broadcast_receiver(camp: Verdicts, run: Run, k: int) -> None:
    """A receiving cell dies (or its receiving thread stalls) mid-bucket: the trainer finishes
    the others, the cell catches up point to point, nobody serves a partial version. Every op
    is posted at once, so the bytes keep arriving while the thread stalls: the stall outlasts
    the sender's wait for reports (an op timeout + SETTLE_EXTRA_S) to leave the cell unreported."""
    variant = ["kill", "stall"][k % 2]
    victim = f"cell-{run.rng.randrange(CELLS)}"
    run.params.update(variant=variant, victim=victim)
    action = "2*kill" if variant == "kill" else f"2*sleep:{TRANSFER_TIMEOUT_S + SETTLE_EXTRA_S + 1.5}"
    camp.restart({victim: {"broadcast.mid_bucket": action}})
    camp.start_clients(run, 3)
    v = camp.next_version
    camp.next_version += 1
    run.params["version"] = v
    t = camp.publish(v)
    if variant == "kill":
        if camp.await_fault(run, lambda: camp.nem.killed(victim), 60, "SIGKILL", victim,
                            failpoint="broadcast.mid_bucket"):
            camp.restart({victim: None})
    t.join(90)
    if t.is_alive():
        raise Hang(f"broadcast of version {v}")
    res = camp.last_broadcast
    if variant == "stall" and res is not None and (res.failed or res.num_attempts > 1):
        camp.fault(run, "stall", victim, failpoint="broadcast.mid_bucket", attempts=res.num_attempts,
                   failed=sorted(res.failed))
    elif variant == "stall":
        run.notes.append(f"stall did not disturb the broadcast: {res}")


def scn_scoring_fault(camp: Verdicts, run: Run, k: int) -> None:
    """A cell dies (or its scoring fails) at a scoring task while a superseded version's
    tokens get their old log-probs: the version retires only once every token is scored."""
    variant = ["kill", "raise"][k % 2]
    victim = f"cell-{run.rng.randrange(CELLS)}"
    run.params.update(variant=variant, victim=victim)
    camp.restart({victim: {"logprob.final_pass": f"1*{variant}"}})
    offset = camp.nem.log_size(victim)
    hit = (lambda: camp.nem.killed(victim)) if variant == "kill" else (
        lambda: camp.nem.log_has(victim, offset, "failpoint logprob.final_pass"))
    # a range is scored by a verified cell other than its sampler, the least loaded (ties spread
    # by the range): the victim gets a final-pass task within a round or two of versions
    for attempt in range(3):
        camp.start_clients(run, 3, min_tokens=20)
        v = camp.next_version
        camp.next_version += 1
        run.params["version"] = v
        t = camp.publish(v)
        deadline = time.monotonic() + 30
        while not hit() and time.monotonic() < deadline:
            time.sleep(0.05)
        t.join(90)
        if hit() or attempt == 2:
            break
    kind = "SIGKILL" if variant == "kill" else "raise"
    if camp.await_fault(run, hit, 30, kind, victim, failpoint="logprob.final_pass"):
        if variant == "kill":
            camp.restart({victim: None})
        else:
            camp.nem.armed.pop(victim, None)

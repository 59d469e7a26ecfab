"""Faults inside a live migration: kills and raises at each failpoint, a partition, zombies."""

from __future__ import annotations

import signal
import time

from faultkit.runs import Run
from faultkit.scenarios.common import _mig_kill, _migration_setup
from faultkit.settings import ALL_FPS, CELLS, DST_FPS, LEASE_S, SRC_FPS, TRANSFER_TIMEOUT_S
from faultkit.verdicts import Verdicts


def scn_mig_kill_source(camp: Verdicts, run: Run, k: int) -> None:
    _mig_kill(camp, run, k, "S", SRC_FPS)


def scn_mig_kill_destination(camp: Verdicts, run: Run, k: int) -> None:
    _mig_kill(camp, run, k, "D", DST_FPS)


def scn_mig_raise(camp: Verdicts, run: Run, k: int) -> None:
    fp = ALL_FPS[k % len(ALL_FPS)]
    side = "S" if fp in SRC_FPS else "D"
    run.params["failpoint"] = fp
    offsets = {f"cell-{i}": camp.nem.log_size(f"cell-{i}") for i in range(CELLS)}
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*raise"}})
    victim = S if side == "S" else D
    if camp.await_fault(run, lambda: camp.nem.log_has(victim, offsets[victim], f"failpoint {fp}"), 30, "raise",
                        victim, failpoint=fp):
        camp.nem.armed.pop(victim, None)  # a spent `1*raise` is harmless: no restart needed


def scn_partition_transfer(camp: Verdicts, run: Run, k: int) -> None:
    """The destination's migration thread is held inside the transfer (no bytes flow): the
    source's own transfer timeout must fire, it aborts, keeps decoding, and the flip retries."""
    offsets = {f"cell-{i}": camp.nem.log_size(f"cell-{i}") for i in range(CELLS)}
    S, D, X, _ = _migration_setup(camp, run, {"D": {"migrate.transfer": "1*block"}})
    # the fault's time is when the transfer blocks (recovery counts from there, through the
    # source's timeout), not when the source reports its recovery
    if camp.await_fault(run, lambda: camp.nem.log_has(D, offsets[D], "failpoint migrate.transfer"), 30,
                        "partition", D, failpoint="migrate.transfer"):
        camp.wait(lambda: camp.nem.log_has(S, offsets[S], "failed at the source"), 60, "the source's timeout")
    # the held thread never returns: the destination is restarted (healed) by the next healthy()


def scn_zombie_cell(camp: Verdicts, run: Run, k: int) -> None:
    """SIGSTOP a cell with requests past its lease, then SIGCONT: it must be fenced, its
    requests re-placed, and nothing it sends afterwards accepted."""
    camp.start_clients(run, 3)
    owners = camp.owners(run)
    victim = run.rng.choice(sorted(owners) or [f"cell-{i}" for i in range(CELLS)])
    run.params["victim"] = victim
    if camp.nem.signal(victim, signal.SIGSTOP, "zombie"):
        camp.fault(run, "SIGSTOP", victim)
        time.sleep(LEASE_S * 1.6)
        if camp.nem.signal(victim, signal.SIGCONT, "zombie wakes"):
            camp.fault(run, "SIGCONT", victim)


def scn_zombie_destination(camp: Verdicts, run: Run, k: int) -> None:
    """The destination stops itself right after its commit, past its lease and past the
    source's transfer timeout: the source must not resume (the commit won), the zombie must
    be fenced when it wakes, the request continues elsewhere."""
    S, D, X, _ = _migration_setup(camp, run, {"D": {"migrate.after_commit": "1*stop"}})
    if camp.await_fault(run, lambda: camp.nem.stopped(D), 30, "SIGSTOP", D, failpoint="migrate.after_commit"):
        time.sleep(max(LEASE_S * 1.6, TRANSFER_TIMEOUT_S + 1.5))
        if camp.nem.signal(D, signal.SIGCONT, "zombie wakes"):
            camp.fault(run, "SIGCONT", D)

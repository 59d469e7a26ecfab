"""What the migration scenarios share: the cells' parts and the migration set-up."""

from __future__ import annotations

import random
import time

from faultkit.runs import Run
from faultkit.settings import CELLS, LEASE_S
from faultkit.verdicts import Verdicts


def _names(rng: random.Random) -> tuple[str, str, str]:
    s, d, x = rng.sample(range(CELLS), 3)
    return f"cell-{s}", f"cell-{d}", f"cell-{x}"


def _migration_setup(camp: Verdicts, run: Run, armed: dict[str, dict[str, str]],
                     tokens: tuple[int, int] = (250, 400)) -> tuple[str, str, str, str | None]:
    """Every request on S, D the only other rollout cell, X training; then S flips to
    training, so S's requests migrate to D. `armed`: {"S"|"D": failpoints}."""
    S, D, X = _names(run.rng)
    run.params.update(source=S, destination=D)
    plan = {S if k == "S" else D: fps for k, fps in armed.items()}
    if plan:
        camp.restart(plan)
    camp.flip_all(run, [(X, "training"), (D, "training")])
    camp.start_clients(run, 3, tokens=tokens)
    camp.flip_all(run, [(D, "rollout")])
    fid = camp.post_flip(run, S, "training")
    return S, D, X, fid


def _maybe_wait_lease(camp: Verdicts, run: Run) -> None:
    """Half the runs restart the victim at once (its new incarnation fences the old one),
    half only after its lease ran out (the scheduler fences it)."""
    if run.rng.random() < 0.5:
        time.sleep(LEASE_S * 1.5)
        run.params["restart"] = "after_lease"
    else:
        run.params["restart"] = "at_once"


def _mig_kill(camp: Verdicts, run: Run, k: int, side: str, fps: list[str]) -> None:
    """SIGKILL the migration's source ("S") or destination ("D") at the k-th of its failpoints,
    then restart it (after its lease ran out, or at once)."""
    fp = fps[k % len(fps)]
    run.params["failpoint"] = fp
    S, D, X, _ = _migration_setup(camp, run, {side: {fp: "1*kill"}})
    victim = S if side == "S" else D
    if camp.await_fault(run, lambda: camp.nem.killed(victim), 30, "SIGKILL", victim, failpoint=fp):
        _maybe_wait_lease(camp, run)
        camp.restart({victim: None})

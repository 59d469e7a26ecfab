"""How much of the oracle's edge on a workload is knowledge the planner cannot measure?

    python bench/sim/probe.py [--workload sinusoidal] [--cells 1000] [--hours 24] [--seed 1] [--json]

Runs on one workload and seed: `cellflip` (the planner on its measured snapshot), the oracle
(the better of its two sizings, as bench/cluster_sim.py reports it), and the same planner
(`scheduler.planner.plan.plan_flips`, unchanged) shown more than the controller can measure:
- `phase`: the finish rate per slot replaced by the workload's true rate of the sessions
  starting now (1 / their mean slot time), `--lead` seconds ahead (0: no forecast);
- `new_sessions`: the same estimated from what could be measured, the token rate of the
  sessions admitted in the last ten minutes over the mean tokens of a session (held while
  none start, as when parked sessions take every free slot).
Each with flips limited to free rollout room (the planner's default) and with parking
allowed (`flip_into_room=False`: a flip beyond the room suspends sessions, which resume by
re-prefill). And `follow+park`: the planner on the snapshot the controller measures (the rate of
the sessions starting now among its fields), with its opt-in `PlannerPolicy(follow_new_sessions=True,
park_moving=True)`. A diagnostic for the README's account of the `sinusoidal` target, not a policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parents[1]), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from scheduler.planner.types import PlannerPolicy, Snapshot  # noqa: E402
from sim.cluster import INF, Cluster  # noqa: E402
from sim.policies import ORACLE_SOURCES, Planned, make_policy  # noqa: E402
from sim.run import run_policy  # noqa: E402
from sim.workload import load_workload  # noqa: E402

NEW_WINDOW_S = 600.0
"""Sessions admitted this recently measure the token rate of the sessions starting now."""


class Informed(Planned):
    """The planner shown a finish rate per slot it cannot measure (module docstring)."""

    def __init__(self, source: str, park: bool, lead_s: float = 0.0) -> None:
        super().__init__(f"{source}{'+park' if park else ''}", "kv", PlannerPolicy(flip_into_room=not park))
        self.source, self.lead_s, self.rate = source, lead_s, 0.0

    def view(self, cl: Cluster, t: float, snap: Snapshot) -> Snapshot:
        if self.source == "phase":
            self.rate = 1.0 / (float(cl.wl.mean_hours_at(t + self.lead_s, cl.horizon_s)) * 3600.0)
        else:  # sessions admitted (not moved or resumed) within the window: t0 == occ == start
            new = (cl.end < INF) & (cl.occ >= t - NEW_WINDOW_S) & (cl.t0 >= cl.occ)
            if new.sum() >= cl.k:
                self.rate = float((cl.tok[new] / cl.dur[new]).mean()) / cl.wl.session_tokens
        rate = self.rate or snap.finish_rate_per_slot_s
        return dataclasses.replace(snap, finish_rate_per_slot_s=rate)


def probe(workload: str, cells: int, hours: float, seed: int, lead_s: float) -> dict:
    wl = load_workload(workload)
    out: dict[str, dict] = {}

    def record(name: str, r) -> None:
        out[name] = {"trained_tokens_per_hour": round(r.trained_tokens_per_hour, 1),
                     "suspended": int(r.moves.get("suspend", 0))}
        print(f"  {name:<20}{r.trained_tokens_per_hour / 1e6:>9.1f} Mtok/h{out[name]['suspended']:>9} suspends",
              flush=True)

    record("cellflip", run_policy(wl, make_policy("cellflip"), cells, hours, seed=seed))
    oracle = max((run_policy(wl, make_policy(f"oracle:{s}"), cells, hours, seed=seed) for s in ORACLE_SOURCES),
                 key=lambda r: r.trained_tokens_per_hour)
    record("oracle", oracle)
    follow = PlannerPolicy(follow_new_sessions=True, park_moving=True)
    record("follow+park", run_policy(wl, Planned("follow+park", "kv", follow), cells, hours, seed=seed))
    for source in ("phase", "new_sessions"):
        for park in (False, True):
            pol = Informed(source, park, lead_s)
            record(pol.name, run_policy(wl, pol, cells, hours, seed=seed))
    top = out["oracle"]["trained_tokens_per_hour"]
    return {"workload": workload, "cells": cells, "hours": hours, "seed": seed, "lead_s": lead_s,
            "policies": out, "oracle_fraction": {k: round(v["trained_tokens_per_hour"] / top, 4) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="sinusoidal")
    ap.add_argument("--cells", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lead", type=float, default=0.0, help="seconds `phase` looks ahead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print(f"probe: {args.workload}, {args.cells} cells, {args.hours:g} h, seed {args.seed}")
    result = probe(args.workload, args.cells, args.hours, args.seed, args.lead)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()

"""`bench/e2e.py --rl-jobs N`: N toy RL jobs (different seeds and task variants) on ONE fleet of
4 cells, each with a learning-rate-0 control run on a second fleet; the fleets are what
`cellflip up --rl-jobs` starts (cells/rl_jobs_up.py: one warm-up for every job and both fleets,
jobs created with the admin token, job-bound tokens, one trainer process per job).

The scheduler's own planning drives the fleet: each job's rollout vs training flips are its
`plan_flips` on its own snapshot, the moves between jobs the division's. One move is forced, the
one the planner would not make on such a short run: each job's `min_cells` (2 of 4 cells) takes
the whole fleet, so the division has nothing to move. Once both jobs have published (`Mover`),
one cell is moved from job 0 to job 1 (`POST /v1/jobs/{name}/cells`) while it decodes job 0's
live rollouts; job 0 then sits under its `min_cells` and the division moves a cell back
(`planner_moves`).

Fields:
- jobs: {name: {heldout_first, heldout_last, heldout_control_last, lost_rollouts, exact_frac,
  steps, versions}}: greedy held-out reward of the job's first (the shared warm start) and last
  published versions on ITS task variant, the control's last, episodes abandoned on an error,
  trained-on sampled tokens with an exact old log-prob.
- cross_job_moves: moves between two jobs finished (`done`) in the RL fleet (the store's
  `job_moves`); planner_moves: those the scheduler's division started (the rest: the forced one);
  moved_rollouts: live rollouts migrated out of a cell while it drained for such a move;
  moved_outside_job: those that went to a cell not then of the rollout's job (must be 0).
- flips: the RL fleet's finished flips by who asked (`planner`: each job's own `plan_flips`,
  `trainer`: a step the planner gave no cell, `moves`: the drains and loads of moves).
- foreign_tokens: sampled tokens re-scored under every published version of every job
  (cells/foreign_tokens.py) that another job's weights reproduce better than their own job's;
  foreign_check: the counts behind it (checked, own, shared with the warm start, unmatched).
- run_s: the RL fleet's run (jobs created to every trainer done); control_run_s; wall_s.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from cells.rl_jobs import JobsFile, parse_jobs
from cells.rl_jobs_up import follow, launch_jobs, serve_from, warm_checkpoint
from cells.trainer.toy_task import TOY_RENDERER

TASKS = [{}, {"p_pair": 0.6, "p_redirect": 0.1}, {"p_pair": 0.1, "p_redirect": 0.6}]
HELDOUT = 32
SAMPLE = 6
"""Trajectories re-scored per job (random) for the foreign-token check, plus up to SAMPLE that
a moved cell sampled tokens of."""


def jobs_file(n: int, steps: int, lr: float | None) -> JobsFile:
    trainer = {"steps": steps, "batch_episodes": 32, "group_size": 8, "agents": 12, "export_every": 1,
               "train_cell_choice": "busiest", "long_fraction": 0.1,
               **({"lr": lr} if lr is not None else {})}
    return parse_jobs({"warmup": {"steps": 300, "seed": 0}, "jobs": [
        {"name": f"job-{chr(97 + i)}", "seed": i, "task": TASKS[i % len(TASKS)], "min_cells": 2, "max_cells": 3,
         "trainer": dict(trainer)} for i in range(n)]}, "bench")


def fleet_config(tmp: Path) -> dict:
    from cells.entry import prepare_toy

    raw = {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 10.0, "heartbeat_s": 0.25,
                      "min_rollout_cells": 1, "drain_deadline_s": 60.0},
        "cells": {"count": 4, "export_root": str(tmp / "exports"),
                  "engine": {"type": "embedded", "model": {"preset": "toy"}, "num_blocks": 1024, "block_size": 16,
                             "max_running": 8, "batch_invariant": True}},
        "migration": {"transfer_timeout_s": 20.0},
        # a new version re-prefills running requests: every sampled token is then some one
        # version's, which the foreign-token check re-scores (keep_kv's would be unmatched)
        "versions": {"inflight_policy": "recompute"},
        "gateway": {"renderer": TOY_RENDERER},
        "trainer": {"enabled": True},
    }
    prepare_toy(raw)
    return raw


class Mover(threading.Thread):
    """Moves job 0's busiest rollout cell to job 1 once both jobs have published (their warm
    start) and job 0's cells all serve with live rollouts on one of them; records the move.

    Under the planner's flips a job of 2 cells keeps one in training between its RL steps (its
    balance of rollout and training), so the window where both of job 0's cells serve is mostly
    the one after its warm start, before its first RL step: the move is forced there."""

    def __init__(self, cluster, jobs: JobsFile, timeout_s: float = 900.0):
        super().__init__(daemon=True)
        self.cluster, self.src, self.dst = cluster, jobs.jobs[0].name, jobs.jobs[1].name
        self.timeout_s, self.move, self.error = timeout_s, None, None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline and self.move is None:
            try:
                self._try()
            except Exception as e:  # reported in the result
                self.error = repr(e)[:300]
            time.sleep(0.3)

    def _try(self) -> None:
        http = self.cluster.http
        view = {j["name"]: j for j in http.get("/v1/jobs").json()["jobs"]}
        if any(len(view[j]["versions"]) < 1 for j in (self.src, self.dst)):
            return  # each job published its warm start
        mine = [c for c in self.cluster.cells() if c.get("job") == self.src]
        flips = http.get("/v1/flips", params={"active": "true"}).json()
        busy = {f["cell"] for f in (flips.get("flips", flips) if isinstance(flips, dict) else flips)}
        if len(mine) < 2 or any(c["state"] != "rollout" or c["id"] in busy for c in mine):
            return
        publishers = _publishers(http, view[self.src]["versions"])
        movable = [c for c in mine if c["id"] not in publishers]
        cell = max(movable, key=lambda c: c.get("inflight", 0), default=None)
        if cell is None or cell.get("inflight", 0) < 1:
            return
        r = http.post(f"/v1/jobs/{self.dst}/cells", json={"cell": cell["id"]})
        if r.status_code == 202:
            self.move = {**r.json(), "inflight": cell["inflight"]}


def _publishers(http, versions: list[int]) -> set[str]:
    """Cells whose version host serves a live version of the job (its catch-ups are fetched from
    there). The forced move leaves them alone: a cell's training side follows one trainer store
    at a time, so whether a version host keeps serving its old job's versions after a move is
    not established (docs/JOBS.md, "Not built yet")."""
    rows = http.get("/v1/versions").json()["versions"]
    live = [r for r in rows if r["version"] in set(versions) and r["state"] != "retired"]
    return {(r.get("source") or {}).get("namespace", "").rpartition("/")[2] for r in live}


def run_fleet(tmp: Path, warm: Path, jobs: JobsFile, *, move: bool, say) -> dict:
    from cells.localcluster import Cluster
    from scheduler.store import Store

    raw = fleet_config(tmp)
    serve_from(raw, warm)
    c = Cluster(tmp, num_cells=4, cfg=raw, ready_timeout_s=300)
    mover = None
    try:
        t0 = time.monotonic()
        dirs = launch_jobs(c, raw, jobs, tmp, say)
        if move:
            mover = Mover(c, jobs)
            mover.start()
        codes = follow(c, dirs, say)
        run_s = time.monotonic() - t0
        if mover is not None:
            mover.stop.set()
        view = c.http.get("/v1/jobs").json()
    finally:
        c.stop()
    out = {"codes": codes, "run_s": round(run_s, 1), "raw": raw, "view": view, "dirs": dirs,
           "forced_move": mover.move if mover else None, "mover_error": mover.error if mover else None}
    store = Store(raw["scheduler"]["db_path"])
    try:
        out["moves"] = [m.to_api() for m in store.jobs.list_moves(limit=1000)]
        out["store"] = _store_facts(store, out["moves"], jobs)
    finally:
        store.close()
    return out


def _store_facts(store, moves: list[dict], jobs: JobsFile) -> dict:
    """Migrations out of the cells moved between jobs, each checked against the job its
    destination held at the time; a sample of each job's finished trajectories."""
    names = {j.name for j in jobs.jobs}
    between = [m for m in moves if m["from"] in names and m["to"] in names and m["state"] == "done"]
    drains = {h[2]: m for m in between for h in m["history"] if h[0] == "flip_training"}
    migrated = [mg for mg in store.owners.migrations_of_flips(sorted(drains)) if mg.state == "committed"]
    outside = []
    for mg in migrated:
        src_job = drains[mg.flip_id]["from"]
        if mg.dst == mg.src or _job_at(moves, mg.dst, mg.finished_at or mg.created_at) != src_job:
            outside.append({"migration": mg.id, "dst": mg.dst, "job": src_job})
    items, cursor = [], 0
    while True:
        batch, cursor = store.sessions.trajectories(cursor, 500)
        if not batch:
            break
        items += batch
    job_of = store.jobs.jobs_of("session", [t["id"] for t in items])
    moved_cells = {m["cell"] for m in between}
    touched = {sid for cell in moved_cells for sid, _ in store.sessions.sampled_by(cell)}
    rng, sample = random.Random(0), []
    for name in sorted(names):
        mine = [t for t in items if job_of[t["id"]] == name and any(t["loss_mask"])]
        sample += rng.sample(mine, min(SAMPLE, len(mine)))
        sample += [t for t in mine if t["id"] in touched][:SAMPLE]
    uniq = list({t["id"]: t for t in sample}.values())
    return {"cross_job_moves": len(between), "moved_rollouts": len(migrated), "moved_outside_job": outside,
            "planner_moves": sum(1 for m in between if m["reason"] == PLANNER_MOVE),
            "flips": _flip_origins(store, moves), "sample": uniq, "job_of": {t["id"]: job_of[t["id"]] for t in uniq}}


PLANNER_MOVE = "the planner's division of the fleet"
"""The reason the scheduler's division records on a move it starts (scheduler/control/jobmoves.py)."""


def _flip_origins(store, moves: list[dict]) -> dict[str, int]:
    """Finished flips by who asked: a move between jobs (its drain and load), a trainer (an
    explicit flip, sent with an Idempotency-Key), the planner (its own flips carry none)."""
    of_moves = {h[2] for m in moves for h in m["history"] if h[0] in ("flip_training", "flip_rollout")}
    out = {"planner": 0, "trainer": 0, "moves": 0}
    for f in store.fleet.list_flips(limit=100_000):
        if f.state == "done":
            out["moves" if f.id in of_moves else "trainer" if f.idem_key else "planner"] += 1
    return out


def _job_at(moves: list[dict], cell: str, t: float) -> str:
    """The job `cell` belonged to at time `t`, from the moves' records (reassigned when a move
    entered `loading`); `default` before any."""
    job = "default"
    marks = sorted((h[1], m["to"]) for m in moves if m["cell"] == cell for h in m["history"] if h[0] == "loading")
    for at, to in marks:
        if at <= t:
            job = to
    return job


class Versions(Mapping):
    """A job's exported versions (`exports/jobs/NAME/vN`, written by the cells holding them),
    each loaded when asked for."""

    def __init__(self, root: Path, spec):
        self.spec = spec
        self.paths = {int(d.name[1:]): d for d in root.glob("v*") if (d / "config.json").is_file()}

    def __getitem__(self, v: int):
        from cells.engine.embedded.checkpoint import load_checkpoint

        return load_checkpoint(self.paths[v], self.spec)

    def __iter__(self):
        return iter(sorted(self.paths))

    def __len__(self) -> int:
        return len(self.paths)


def _summary(log: Path) -> dict:
    """The trainer's last line: `{"summary": ...}`."""
    for line in reversed(log.read_text().splitlines()) if log.is_file() else []:
        if line.startswith('{"summary"'):
            return json.loads(line)["summary"]
    return {}


def _job_figures(fleet: dict, control: dict, tmp: Path, jobs: JobsFile, spec) -> dict:
    from cells.trainer.toy_task import TaskSpec, heldout_eval

    out = {}
    for job in jobs.jobs:
        task = TaskSpec.variant(job.seed, job.task)
        rl = Versions(tmp / "rl" / "exports" / "jobs" / job.name, spec)
        ctl = Versions(tmp / "control" / "exports" / "jobs" / job.name, spec)

        def score(vs: Versions, pick, task=task) -> float | None:
            return round(heldout_eval(spec, vs[pick(vs)], task, HELDOUT)["reward"], 4) if len(vs) else None
        s = _summary(tmp / "rl" / f"trainer-{job.name}.log")
        out[job.name] = {"heldout_first": score(rl, min), "heldout_last": score(rl, max),
                         "heldout_control_last": score(ctl, max), "lost_rollouts": s.get("lost_rollouts"),
                         "exact_frac": s.get("exact_frac"), "steps": s.get("steps"), "versions": len(rl),
                         "exit": fleet["codes"].get(job.name), "control_exit": control["codes"].get(job.name)}
    return out


def run_bench(n: int, quick: bool, say) -> dict:
    from cells.engine.embedded.model_spec import resolve_spec
    from cells.foreign_tokens import attribute
    from cells.trainer.trainer import engine_tile
    from scheduler.contract.config import parse_config

    if n < 2:
        raise SystemExit("--rl-jobs needs at least 2 jobs (a move between jobs)")
    t0 = time.monotonic()
    steps = 6 if quick else 12
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-e2e-jobs-"))
    # one warm-up for every job and both fleets (kept between runs: reused when it is the same)
    warm = warm_checkpoint(fleet_config(tmp), Path(tempfile.gettempdir()) / "cellflip-e2e-jobs-warm", 300, 0, say)
    jobs = jobs_file(n, steps, None)
    rl = run_fleet(tmp / "rl", warm, jobs, move=True, say=say)
    # the control: lr 0 keeps every job's weights at the warm start whatever the steps
    ctl = run_fleet(tmp / "control", warm, jobs_file(n, 2, 0.0), move=False, say=say)
    cfg = parse_config(rl["raw"])
    spec = resolve_spec(cfg.cells.engine.model)
    facts = rl["store"]
    weights = {j.name: Versions(tmp / "rl" / "exports" / "jobs" / j.name, spec) for j in jobs.jobs}
    check = attribute(facts["sample"], facts["job_of"], weights, spec, row_tile=engine_tile(cfg) or 1,
                      temperature=cfg.trainer.temperature)
    return {"num_jobs": n, "steps": steps, "jobs": _job_figures(rl, ctl, tmp, jobs, spec),
            "cross_job_moves": facts["cross_job_moves"], "moved_rollouts": facts["moved_rollouts"],
            "moved_outside_job": len(facts["moved_outside_job"]), "planner_moves": facts["planner_moves"],
            "flips": facts["flips"], "forced_move": rl["forced_move"],
            "mover_error": rl["mover_error"],
            "foreign_tokens": check["foreign"],
            "foreign_check": {k: check[k] for k in ("checked", "own", "shared", "unmatched", "versions")}
            | {"trajectories": len(facts["sample"]), "examples": check["foreign_tokens"][:3]},
            "run_s": rl["run_s"], "control_run_s": ctl["run_s"], "wall_s": round(time.monotonic() - t0, 1)}

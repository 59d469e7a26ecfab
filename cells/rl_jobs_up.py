"""`cellflip up --rl-jobs FILE`: one local fleet, several toy RL jobs (cells/rl_jobs.py reads
the file).

One line: the file checked -> the supervised warm-up, once, written as a Hugging Face directory
every cell and every job starts from -> the scheduler and N cells -> each job created (`POST
/v1/jobs`, admin), its cells moved in (`POST /v1/jobs/{name}/cells`), its own agent and trainer
tokens minted (`POST /v1/tokens` with `job`) -> one trainer process per job (its agents and RL
loop), holding only its job's tokens: it sees, flips and trains on its job's cells only ->
status lines per job until every trainer is done; Ctrl-C stops every process.

The scheduler's own planning drives the fleet (`scheduler.auto_flip` on): each job's rollout vs
training flips are `plan_flips` on the job's own snapshot once its trainer declared its demand,
and the moves between jobs are the division's (`scheduler.planner.jobs.divide`, from each job's
measured demand). A trainer flips a cell itself only when the planner gave its step none.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cells.rl_jobs import JobsFile, JobsFileError, JobSpec, trainer_config

WARM_DIR = "warm-start"


def warm_checkpoint(raw: dict, out: Path, steps: int, seed: int, say: Callable[[str], None]) -> Path:
    """The toy task's supervised warm-up (`steps` SFT steps on the teacher's demonstrations
    made from `seed`), run once here and written to `out` as a Hugging Face directory. An `out`
    already holding the same warm-up (its `warmup.json`) is reused."""
    from scheduler.contract.config import parse_config

    mark = {"steps": steps, "seed": seed, "model": raw["cells"]["engine"]["model"]}
    done = out / "warmup.json"
    if done.is_file() and json.loads(done.read_text()) == mark:
        say(f"warm start {out} (reused)")
        return out
    import shutil

    import torch

    from cells.engine.embedded.checkpoint import save_checkpoint
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import resolve_spec
    from cells.rl.learner import Learner
    from cells.rl.sft import sft_steps
    from cells.trainer.trainer import engine_tile
    from cells.trainer.warmup import toy_demos

    torch.set_num_threads(1)
    cfg = parse_config(raw)
    spec, tc, model = resolve_spec(cfg.cells.engine.model), cfg.trainer, cfg.cells.engine.model
    learner = Learner(spec, init_weights(spec, model.seed, tc.init_std), lr=tc.warmup_lr, tile=engine_tile(cfg),
                      seed=seed)
    every = max(1, steps // 10)
    t0 = time.monotonic()

    def progress(step: int, loss: float) -> None:
        if step % every == 0 or step == steps:
            say(f"warm-up {step}/{steps}, loss {loss:.3f} ({time.monotonic() - t0:.0f} s)")

    say(f"the supervised warm-up, once for every job: {steps} steps")
    sft_steps(learner, [tuple(d) for d in toy_demos(seed)], steps=steps, batch_size=tc.warmup_batch,
              on_step=progress)
    shutil.rmtree(out, ignore_errors=True)
    save_checkpoint(out, spec, learner.weights())
    done.write_text(json.dumps(mark))
    return out


def serve_from(raw: dict, path: Path) -> None:
    """Every cell starts from the warmed checkpoint (the toy vocabulary's output ids kept); the
    scheduler plans the flips (each job's own, on its snapshot) and the moves between jobs."""
    model = raw["cells"]["engine"]["model"]
    raw["cells"]["engine"]["model"] = {"path": str(path.resolve()), "output_id_ranges": model["output_id_ranges"]}
    raw.setdefault("scheduler", {})["auto_flip"] = True


def create_jobs(http, jobs: JobsFile, model: str) -> None:
    """`POST /v1/jobs` for every job (admin token); an existing job of the same name is an error
    (a store reused from another run: use a fresh --run-dir)."""
    for job in jobs.jobs:
        r = http.post("/v1/jobs", json=job.create_body(model))
        if r.status_code == 409:
            raise JobsFileError(f"job {job.name!r} exists in this store already (a fresh --run-dir starts clean)")
        if r.status_code != 201:
            raise JobsFileError(f"job {job.name!r} refused: {r.status_code} {r.text[:300]}")


def mint_tokens(http, job: str) -> dict[str, str]:
    """The job's own agent and trainer tokens (`POST /v1/tokens` with `job`)."""
    out = {}
    for scope in ("agent", "trainer"):
        r = http.post("/v1/tokens", json={"scope": scope, "name": f"{job}-{scope}", "job": job})
        if r.status_code != 201:
            raise RuntimeError(f"could not mint {job}'s {scope} token: {r.status_code} {r.text[:300]}")
        body = r.json()
        if body.get("job") != job:
            raise RuntimeError(f"the {scope} token minted for {job} is bound to {body.get('job')!r}")
        out[scope] = body["token"]
    return out


def assign_cells(cluster, jobs: JobsFile, timeout_s: float = 180.0) -> dict[str, list[str]]:
    """Move each job its cells (its `min_cells`, at least 2), in the file's order, and wait until
    every move is done; returns each job's cells. The scheduler's own division may start moving a
    cell into a job meanwhile (the jobs' `min_cells` ask for it): such a move counts, and a cell it
    took is not asked for again."""
    want = {j.name: max(j.min_cells, 2) for j in jobs.jobs}
    for job in jobs.jobs:
        for _ in range(4 * want[job.name] + 4):  # bounded: each round moves one cell, or finds one moving
            if not _move_one(cluster, job.name, want[job.name]):
                break

    def settled() -> dict[str, list[str]] | None:
        view = cluster.http.get("/v1/jobs").json()
        held = {j["name"]: j["cells"] for j in view["jobs"]}
        busy = [m for m in view["moves"] if m["state"] in ("draining", "loading")]
        rollout = {c["id"] for c in cluster.cells() if c["state"] == "rollout"}
        ok = not busy and all(len(held.get(n, [])) >= k and set(held[n]) <= rollout for n, k in want.items())
        return {n: held[n] for n in want} if ok else None

    return cluster.wait(settled, timeout_s, "every job's cells moved in", every=0.5)


def _move_one(cluster, job: str, want: int) -> bool:
    """One free cell (the implicit job's, not moving) moved into `job`, unless it holds or is
    getting `want` cells already (False). A cell that began moving meanwhile is looked at again."""
    view = cluster.http.get("/v1/jobs").json()
    moving = {m["cell"]: m["to"] for m in view["moves"] if m["state"] in ("draining", "loading")}
    held = next((j["cells"] for j in view["jobs"] if j["name"] == job), [])
    if len(set(held) | {c for c, to in moving.items() if to == job}) >= want:
        return False
    free = sorted(c["id"] for c in cluster.cells() if c.get("job", "default") == "default" and c["id"] not in moving)
    if not free:
        raise RuntimeError(f"no free cell left to move into {job}")
    r = cluster.http.post(f"/v1/jobs/{job}/cells", json={"cell": free[0]})
    if r.status_code != 202 and (r.status_code != 409 or
                                 r.json().get("reason") not in ("move_in_progress", "flip_in_progress")):
        raise RuntimeError(f"could not move {free[0]} into {job}: {r.status_code} {r.text[:300]}")
    if r.status_code == 409:
        time.sleep(0.2)  # it began moving meanwhile: look again once the scheduler has recorded it
    return True


def start_trainer(cluster, raw: dict, job: JobSpec, index: int, tokens: dict[str, str], run_dir: Path) -> Path:
    """The job's trainer process with its own tokens only; returns its run directory."""
    import yaml

    from scheduler.contract.tokens import SCOPE_ENV, TOKEN_ENV

    jdir = run_dir / "jobs" / job.name
    jdir.mkdir(parents=True, exist_ok=True)
    cfg_path = jdir / "trainer.yaml"
    cfg_path.write_text(yaml.safe_dump(trainer_config(raw, job, index, run_dir)))
    status = jdir / "trainer.jsonl"
    if status.exists():
        status.replace(status.with_suffix(".jsonl.prev"))
    env = {TOKEN_ENV: None, SCOPE_ENV["trainer"]: tokens["trainer"], SCOPE_ENV["agent"]: tokens["agent"]}
    cluster.start_trainer(["--config", str(cfg_path), "--scheduler", cluster.url, "--run-dir", str(jdir),
                           "--tag", job.name], env=env, name=f"trainer-{job.name}")
    return jdir


def launch_jobs(cluster, raw: dict, jobs: JobsFile, run_dir: Path, say: Callable[[str], None]) -> dict[str, Path]:
    """Jobs, their cells, their tokens, their trainers; returns each job's run directory."""
    model = raw["cells"]["engine"]["model"]["path"]
    create_jobs(cluster.http, jobs, model)
    held = assign_cells(cluster, jobs)
    say("cells per job: " + ", ".join(f"{n} {sorted(c)}" for n, c in held.items()))
    dirs = {}
    for i, job in enumerate(jobs.jobs):
        tokens = mint_tokens(cluster.http, job.name)
        dirs[job.name] = start_trainer(cluster, raw, job, i, tokens, run_dir)
        say(f"job {job.name}: trainer started (seed {job.seed}, task {job.task or 'default'}, its own tokens); "
            f"status {dirs[job.name] / 'trainer.jsonl'}")
    return dirs


def follow(cluster, dirs: dict[str, Path], say: Callable[[str], None], poll_s: float = 0.5) -> dict[str, Any]:
    """Each job's step lines until every trainer exits; returns each trainer's exit code (a cell
    or the scheduler exiting ends the wait with 1 for every trainer still running)."""
    from cells import display

    seen = dict.fromkeys(dirs, 0)
    trainers = {n: cluster.procs[f"trainer-{n}"] for n in dirs}
    others = [p for name, p in cluster.procs.items() if not name.startswith("trainer-")]
    while True:
        for name, d in dirs.items():
            lines = display.read_status(d / "trainer.jsonl")
            for rec in lines[seen[name]:]:
                if rec.get("event") in ("step", "published", "warmup_done", "step_failed"):
                    say(f"[{name}] " + json.dumps({k: rec[k] for k in ("event", "step", "version", "reward")
                                                   if k in rec}))
            seen[name] = len(lines)
        if all(p.poll() is not None for p in trainers.values()):
            return {n: p.poll() for n, p in trainers.items()}
        if any(p.poll() is not None for p in others):
            say("a scheduler or cell process exited; stopping")
            return {n: (p.poll() if p.poll() is not None else 1) for n, p in trainers.items()}
        time.sleep(poll_s)


def cmd_up_rl_jobs(args) -> int:
    """`cellflip up --rl-jobs FILE` (the module notes)."""
    import os

    from cells.entry import interrupt, stop_on_signals
    from cells.localcluster import Cluster

    stop_on_signals(interrupt)  # Ctrl-C and a plain kill stop the children too
    say = lambda msg: print(f"cellflip up: {msg}", flush=True)  # noqa: E731
    raw, jobs, n = _prepare(args)
    run_dir = Path(os.path.abspath(args.run_dir))
    raw["scheduler"]["db_path"] = str(run_dir / "rl-jobs.sqlite")
    try:
        warm = warm_checkpoint(raw, run_dir / WARM_DIR, jobs.warmup_steps, jobs.warmup_seed, say)
        serve_from(raw, warm)
        port = args.port if args.port is not None else raw["scheduler"].get("port", 8700)
        cluster = Cluster(run_dir, num_cells=n, cfg=raw, port=port, progress=say)
    except KeyboardInterrupt:
        return 0
    try:
        say(f"API {cluster.url}; {n} cells; jobs {', '.join(j.name for j in jobs.jobs)}; logs {run_dir}/*.log; "
            "Ctrl-C stops everything")
        codes = follow(cluster, launch_jobs(cluster, raw, jobs, run_dir, say), say)
        say("trainers done: " + ", ".join(f"{k} exit {v}" for k, v in codes.items()))
        return 0 if all(c == 0 for c in codes.values()) else 1
    except JobsFileError as e:
        print(f"cellflip up --rl-jobs: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the shutdown short
        cluster.stop()


def _prepare(args) -> tuple[dict, JobsFile, int]:
    """The config and the jobs file, checked before anything starts (SystemExit with one line)."""
    import os

    import yaml

    from cells.entry import load, prepare_toy
    from cells.rl_jobs import check_fits, load_jobs_file
    from scheduler.contract.config import ConfigError
    from scheduler.contract.tokens import server_tokens

    if args.ray is not None:
        raise SystemExit("cellflip up --rl-jobs: runs on this machine only (no --ray)")
    try:
        jobs = load_jobs_file(args.rl_jobs)
        cfg = load(args.config)
        with open(args.config) as f:
            raw = yaml.safe_load(f) or {}
        need = sum(max(j.min_cells, 2) for j in jobs.jobs)
        n = args.cells or max(raw.get("cells", {}).get("count", need), need)
        check_fits(jobs, n)
        if server_tokens(cfg.scheduler) is None:
            raise JobsFileError("several jobs need job-bound tokens: scheduler.auth must not be `none`")
    except (JobsFileError, ConfigError, OSError) as e:
        raise SystemExit(f"cellflip up --rl-jobs: {e}") from None
    raw.setdefault("scheduler", {})
    for job in jobs.jobs:
        if args.steps is not None:
            job.trainer["steps"] = args.steps
    if args.quick:
        jobs = JobsFile(jobs.jobs, min(jobs.warmup_steps, 40), jobs.warmup_seed)
        for job in jobs.jobs:
            job.trainer.update({k: v for k, v in QUICK_JOB.items() if k not in job.trainer or k == "steps"})
    prepare_toy(raw)
    os.makedirs(args.run_dir, exist_ok=True)
    return raw, jobs, n


QUICK_JOB = {"steps": 1, "batch_episodes": 8, "agents": 8, "group_size": 4}
"""`--quick`: one RL step per job after a 40-step warm-up."""

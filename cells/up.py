"""`cellflip up`: the scheduler, N cells and the trainer on this machine (or as actors on a
Ray cluster), the trainer's live view, and Ctrl-C stopping every process.

Imports are lazy, as in cells/cli.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

from cells.entry import interrupt, launcher_for, load, prepare_toy, stop_on_signals

QUICK = {"steps": 1, "warmup_steps": 40, "batch_episodes": 8, "agents": 8, "group_size": 4}
"""`cellflip up --quick`: one full cycle (warm-up, flip with live migration, train, publish,
flip back) in about a minute on 2 cores; the reward does not rise in one step."""


def cmd_up(args) -> int:
    import yaml

    from cells.localcluster import Cluster

    stop_on_signals(interrupt)  # Ctrl-C and a plain kill stop the children too
    cfg = load(args.config)  # validate before starting anything
    with open(args.config) as f:
        raw = yaml.safe_load(f) or {}
    sched = raw.setdefault("scheduler", {})
    port = args.port if args.port is not None else sched.get("port", 8700)
    n = args.cells or raw.get("cells", {}).get("count", 3)
    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(sched.get("db_path", "runs/cellflip.sqlite"))), exist_ok=True)
    train = cfg.trainer.enabled and not args.no_trainer
    trainer = raw.setdefault("trainer", {})
    if args.quick:
        trainer.update(QUICK)
    if args.steps is not None:
        trainer["steps"] = args.steps
    if train:
        prepare_toy(raw)
    token_note = _ensure_token(cfg)
    say = lambda msg: print(f"cellflip up: {msg}", flush=True)  # noqa: E731
    launcher = launcher_for(cfg, args.ray)
    if launcher.type == "ray":  # the same deployment as actors on a Ray cluster (docs/RAY.md)
        from cells.launch.ray_launcher import up as up_on_ray

        sched["port"] = port
        say(f"API token {token_note}")
        return up_on_ray(raw, launcher, num_cells=n, run_dir=run_dir, train=train,
                         steps=trainer.get("steps", cfg.trainer.steps), plain=args.no_display, say=say,
                         stay=not args.quick)
    try:
        cluster = Cluster(run_dir, num_cells=n, cfg=raw, port=port, progress=say)
    except KeyboardInterrupt:
        return 0
    url = cluster.url
    say(f"API {url} (OpenAPI {url}/docs), OpenAI-compatible gateway {url}/v1, metrics {url}/metrics")
    say(f"API token {token_note}; logs {run_dir}/*.log")
    say(f"{n} cells in rollout; `cellflip status --scheduler {url}`; Ctrl-C stops everything")
    status = os.path.join(run_dir, "trainer.jsonl")
    try:
        if train:
            if os.path.exists(status):
                os.replace(status, status + ".prev")
            cluster.start_trainer(["--config", str(cluster.cfg_path), "--scheduler", url, "--run-dir", run_dir])
            return _follow_trainer(cluster, url, status, trainer.get("steps", cfg.trainer.steps), args.no_display,
                                   stay=not args.quick)
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(0.5)
        print("a process exited; shutting down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def _ensure_token(cfg) -> str:
    """Make sure every scope's token exists before anything starts (each process of the cluster
    gets its own scope's); returns where the admin token is, for the start-up lines."""
    from scheduler.contract.config import ConfigError
    from scheduler.contract.tokens import TOKEN_ENV, default_token_path, server_tokens

    try:
        tokens = server_tokens(cfg.scheduler)
    except ConfigError as e:
        raise SystemExit(f"cellflip up: {e}") from None
    if tokens is None:
        return "none (scheduler.auth: none, loopback only)"
    scoped = f"trainer, cell, agent and scrape tokens beside it ({default_token_path(cfg.scheduler).parent})"
    if cfg.scheduler.auth_token_file:
        return f"(admin) in {cfg.scheduler.auth_token_file}; {scoped}"
    if os.environ.get(TOKEN_ENV):
        return f"(admin) from ${TOKEN_ENV}; {scoped}"
    return f"(admin) in {default_token_path(cfg.scheduler)} (mode 0600); {scoped}"


def _follow_trainer(cluster, url: str, status: str, steps: int, plain: bool, stay: bool = True) -> int:
    """Until the trainer exits: the live view (or, with `plain`, its status lines); then the
    summary. Non-zero if any process died."""
    from pathlib import Path

    from cells import display

    procs = cluster.procs
    done = lambda: procs["trainer"].poll() is not None or any(
        p.poll() is not None for name, p in procs.items() if name != "trainer")
    if plain:
        seen = 0
        while not done():
            lines = display.read_status(Path(status))
            for rec in lines[seen:]:
                print(json.dumps(rec), flush=True)
            seen = len(lines)
            time.sleep(0.5)
        for rec in display.read_status(Path(status))[seen:]:
            print(json.dumps(rec), flush=True)
        last = None
    else:
        last = display.watch(url, Path(status), steps, done, headers=cluster.headers)
    rc = procs["trainer"].poll()
    if last is not None:
        from rich.console import Console

        Console().print(display.summary_table(last))
    if rc != 0:
        print(f"trainer exited with {rc}; see the logs", file=sys.stderr)
        return 1
    if not stay:
        print("cellflip up: the cycle is done; stopping every process", flush=True)
        return 0
    print("cellflip up: training finished; Ctrl-C stops the cluster", flush=True)
    while all(p.poll() is None for name, p in procs.items() if name != "trainer"):
        time.sleep(0.5)
    return 1

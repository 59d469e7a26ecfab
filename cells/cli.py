"""`cellflip` command line: up | scheduler | cell | trainer | status | token | jobs | export | replay |
export-weights (`jobs`: cells/jobs_cli.py; the last three: cells/export/cli.py).

`up` is cells/up.py; `scheduler` runs `python -m scheduler` by module path (the cells import
only the scheduler's config, auth and contract helpers, never its app). Imports are lazy so
that `cellflip scheduler` and `cellflip status` never load torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from cells.entry import (
    build_engine,
    cell_config,
    client_token_for,
    load,
    stop_on_signals,
)


def cmd_scheduler(args) -> int:
    """`python -m scheduler` in this process, by module path: the CLI passes the scheduler its
    command line and never imports its app. A bad token file, or `auth: none` off loopback,
    exits with one line before anything is served."""
    import runpy
    import warnings

    from scheduler.contract.config import ConfigError
    from scheduler.contract.tokens import server_token

    cfg = load(args.config)
    db = args.db or cfg.scheduler.db_path
    os.makedirs(os.path.dirname(os.path.abspath(db)), exist_ok=True)
    sched = cfg.scheduler.model_copy(update={"db_path": db, "host": args.host or cfg.scheduler.host})
    try:
        server_token(sched)  # the check (and first-start token file) the scheduler's app makes
    except ConfigError as e:
        raise SystemExit(f"cellflip scheduler: {e}") from None
    flags = {"--config": args.config, "--db": args.db, "--host": args.host, "--port": args.port}
    argv = [x for flag, v in flags.items() if v is not None for x in (flag, str(v))]
    saved = sys.argv
    sys.argv = ["python -m scheduler", *argv]
    try:
        with warnings.catch_warnings():  # runs afresh even where a caller imported it (tests)
            warnings.filterwarnings("ignore", "'scheduler.__main__' found in sys.modules", RuntimeWarning)
            runpy.run_module("scheduler", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def cmd_cell(args) -> int:
    from cells.agent import CellAgent
    from cells.client import Refused

    cfg = cell_config(args, load(args.config))
    probe = None
    if args.p2p_probe:  # both cells join before either serves
        from cells.transport.probe import LinkProbe

        probe = LinkProbe(json.loads(args.p2p_probe))
    engine = build_engine(cfg.cells.engine)
    # Short GIL hand-offs: transfer threads wake promptly while the engine loop computes.
    sys.setswitchinterval(0.0005)
    agent = CellAgent(cfg, cell_id=args.cell_id, scheduler_url=args.scheduler, engine=engine, host=args.host,
                      token=client_token_for(cfg, scope="cell"), job=args.job)
    agent.manage_gc()  # the process is the cell's
    stop = threading.Event()
    if probe is not None:
        probe.start(agent.quiesce, stop)
    stop_on_signals(lambda *_: stop.set())
    # `kill -USR1 <pid>`: the agent's and engine's state in the cell's log, for post-mortems
    signal.signal(signal.SIGUSR1, lambda *_: logging.getLogger("cellflip.cell").warning(
        "cell %s state: %s", args.cell_id, agent.dump_state()))
    try:
        agent.run(stop)
    except KeyboardInterrupt:
        pass
    except Refused as e:  # e.g. --job names an unknown or draining job, or one of another model
        print(f"cellflip cell {args.cell_id}: registration refused: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_up(args) -> int:
    if args.rl_jobs:
        from cells.rl_jobs_up import cmd_up_rl_jobs

        return cmd_up_rl_jobs(args)
    from cells.up import cmd_up as up

    return up(args)


def cmd_trainer(args) -> int:
    import torch

    from cells.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load(args.config)
    trainer = Trainer(cfg, args.scheduler, run_dir=args.run_dir, token=client_token_for(cfg, scope="trainer"),
                      agent_token=client_token_for(cfg, scope="agent"), tag=args.tag)
    stop = threading.Event()
    stop_on_signals(lambda *_: stop.set())
    try:
        summary = trainer.run(stop)
    except KeyboardInterrupt:
        return 0
    print(json.dumps({"summary": summary}), flush=True)
    return 0


def cmd_status(args) -> int:
    import httpx

    token = client_token_for(load(args.config), args.token_file, scope="trainer")
    try:
        r = httpx.get(f"{args.scheduler}/v1/cells", timeout=5.0,
                      headers={"Authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError as e:
        raise SystemExit(f"cellflip status: cannot reach {args.scheduler}: {e}") from None
    if r.status_code in (401, 403):
        raise SystemExit(f"cellflip status: {args.scheduler} refused the token ({r.status_code}): give a trainer "
                         "or admin token with --token-file, $CELLFLIP_TRAINER_TOKEN or $CELLFLIP_API_TOKEN, or run "
                         "from the directory `cellflip up` ran in")
    if r.status_code != 200:
        raise SystemExit(f"cellflip status: {args.scheduler} answered {r.status_code}: {r.text[:200]}")
    cells = r.json()
    if isinstance(cells, dict) and cells.get("next_cursor"):  # more pages: read them all
        from cells.client import all_cells

        with httpx.Client(timeout=5.0) as http:
            cells = all_cells(http, args.scheduler, {"Authorization": f"Bearer {token}"} if token else None)
    cells = cells.get("cells", cells) if isinstance(cells, dict) else cells
    from cells.display import node_of

    cols = ["id", "node", "state", "generation", "version", "inflight", "kv_blocks_used", "kv_blocks_total"]
    rows = [[node_of(c) if k == "node" else str(c.get(k, "")) for k in cols] for c in cells]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(cols)]
    print("  ".join(h.ljust(w) for h, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    if args.json:
        print(json.dumps(cells))
    return 0


def cmd_token(args) -> int:
    """`cellflip token create|revoke|list` with the admin token: a created token is printed once
    (the scheduler keeps only its hash); a revoked one is refused from the next request on."""
    import httpx

    token = client_token_for(load(args.config), args.token_file, scope="admin")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{args.scheduler}/v1/tokens"
    try:
        if args.action == "create":
            body = {"scope": args.scope, "name": args.name, **({"job": args.job} if args.job else {})}
            r = httpx.post(url, json=body, headers=headers, timeout=10.0)
        elif args.action == "revoke":
            r = httpx.delete(f"{url}/{args.id}", headers=headers, timeout=10.0)
        else:
            r = httpx.get(url, headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise SystemExit(f"cellflip token: cannot reach {args.scheduler}: {e}") from None
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text[:200]
        raise SystemExit(f"cellflip token {args.action}: {args.scheduler} answered {r.status_code}: {detail}"
                         + (" (token management needs the admin token: runs/api.token, $CELLFLIP_API_TOKEN "
                            "or --token-file)" if r.status_code in (401, 403) else ""))
    body = r.json()
    if args.action == "create":
        print(f"id {body['id']} scope {body['scope']}: keep this token, it is not shown again", file=sys.stderr)
        print(body["token"])
    elif args.action == "revoke":
        print(f"revoked {body['id']} ({body['scope']})")
    else:
        for t in body["tokens"]:
            state = "revoked" if t["revoked_at"] is not None else "live"
            print(f"{t['id']}  {t['scope']:<8} {t['origin']:<9} {state:<7} {t['name']}")
    return 0


def _token_parser(sub) -> None:
    tk = sub.add_parser("token", help="create, revoke or list API tokens (admin token)")
    tk_sub = tk.add_subparsers(dest="action", required=True)
    tk_create = tk_sub.add_parser("create", help="print a new token of a scope")
    tk_create.add_argument("--scope", required=True, choices=("admin", "trainer", "cell", "agent", "scrape", "reader"))
    tk_create.add_argument("--name", default="", help="a label: who or what holds it")
    tk_create.add_argument("--job", help="the RL job an agent or trainer token acts on (default: `default`)")
    tk_revoke = tk_sub.add_parser("revoke", help="revoke a token by id (refused from the next request on)")
    tk_revoke.add_argument("id")
    tk_sub.add_parser("list", help="every token's id, scope, origin and state (never the token)")
    for p in tk_sub.choices.values():
        p.add_argument("--scheduler", default="http://127.0.0.1:8700")
        p.add_argument("--config", help="the scheduler's config (where its token file is)")
        p.add_argument("--token-file", help="file holding the admin token (default: $CELLFLIP_API_TOKEN, "
                                            "else the scheduler's generated runs/api.token)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cellflip", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="scheduler + N CPU cells on this machine")
    up.add_argument("--config", default="configs/local.yaml")
    up.add_argument("--port", type=int)
    up.add_argument("--cells", type=int)
    up.add_argument("--steps", type=int, help="RL steps (overrides trainer.steps)")
    up.add_argument("--run-dir", default="runs", help="logs, the store, trainer status and checkpoints")
    up.add_argument("--no-trainer", action="store_true", help="serve the API only")
    up.add_argument("--no-display", action="store_true", help="print status lines instead of the live view")
    up.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="start everything as actors on a running Ray cluster: `auto` (default) or a head's "
                         "host:port (docs/RAY.md)")
    up.add_argument("--quick", action="store_true",
                    help="one full cycle (short warm-up, one RL step with a flip and live migration), then stop")
    up.add_argument("--rl-jobs", metavar="FILE", help="several toy RL jobs on this one fleet, from one warm-up "
                                                      "(configs/jobs/rl_jobs.yaml; docs/JOBS.md)")
    tr = sub.add_parser("trainer", help="run the trainer and the toy task's agents against a scheduler")
    tr.add_argument("--config")
    tr.add_argument("--scheduler", required=True, help="scheduler URL")
    tr.add_argument("--run-dir", default="runs")
    tr.add_argument("--tag", default="run", help="prefix of session ids")
    sc = sub.add_parser("scheduler", help="run the control plane")
    sc.add_argument("--config")
    sc.add_argument("--host")
    sc.add_argument("--port", type=int)
    sc.add_argument("--db", help="SQLite path (overrides the config)")
    ce = sub.add_parser("cell", help="run one cell")
    ce.add_argument("--config")
    ce.add_argument("--scheduler", required=True, help="scheduler URL")
    ce.add_argument("--cell-id", required=True)
    ce.add_argument("--host", default="127.0.0.1", help="address peers use for transfers")
    ce.add_argument("--engine", choices=("embedded", "sglang"), help="inference engine (overrides cells.engine.type)")
    ce.add_argument("--model-path", help="model directory: SGLang's model path, or the embedded model's checkpoint")
    ce.add_argument("--tp", type=int, help="SGLang tensor-parallel degree (overrides cells.engine.tp)")
    ce.add_argument("--job", help="the RL job to register into (default: `default`); an unknown or draining job, "
                    "or one of another model, refuses the cell before it serves")
    ce.add_argument("--p2p-probe", help=argparse.SUPPRESS)  # JSON spec; benchmarks only
    st = sub.add_parser("status", help="print the cells as a table")
    st.add_argument("--scheduler", default="http://127.0.0.1:8700")
    st.add_argument("--json", action="store_true")
    st.add_argument("--config", help="the scheduler's config (where its token file is)")
    st.add_argument("--token-file", help="file holding a trainer or admin token (default: "
                                         "$CELLFLIP_TRAINER_TOKEN, else the scheduler's generated runs/trainer.token)")
    _token_parser(sub)
    from cells.export.cli import add_parsers
    from cells.jobs_cli import add_parsers as add_jobs_parsers

    add_parsers(sub)
    add_jobs_parsers(sub)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if hasattr(args, "func"):  # export, replay, export-weights (cells/export/cli.py)
        return args.func(args)
    return {"up": cmd_up, "scheduler": cmd_scheduler, "cell": cmd_cell, "trainer": cmd_trainer,
            "status": cmd_status, "token": cmd_token}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""`cellflip jobs [list] | create NAME --model M ... | set NAME --settings JSON | delete NAME |
move CELL JOB`: the RL jobs
a fleet serves (docs/JOBS.md), over the scheduler's REST API. `list` prints each job with its
cells, its versions and its demand (open sessions, the planner's target cells); it takes a
trainer or admin token (a job-bound trainer token sees its own job), the others the admin token.
"""

from __future__ import annotations

import argparse
import json
import sys

from cells.entry import client_token_for, load

COLUMNS = ("name", "state", "model", "min", "max", "weight", "cells", "target", "sessions", "versions")


def rows_of(jobs: list[dict]) -> list[list[str]]:
    """One table row per job (`cellflip jobs list`)."""
    out = []
    for j in jobs:
        versions = j.get("versions") or []
        shown = ",".join(str(v) for v in versions[-3:]) + (f" (+{len(versions) - 3})" if len(versions) > 3 else "")
        out.append([j["name"], j["state"], j["model"], str(j["min_cells"]),
                    "-" if j["max_cells"] is None else str(j["max_cells"]), f"{j['weight']:g}",
                    ",".join(j.get("cells") or []) or "-", "-" if j.get("target_cells") is None else str(j["target_cells"]),
                    str(j.get("open_sessions", 0)), shown or "-"])
    return out


def table(rows: list[list[str]], cols: tuple[str, ...] = COLUMNS) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _call(args, method: str, path: str, body: dict | None = None) -> dict:
    import httpx

    scope = "trainer" if args.action == "list" else "admin"
    token = client_token_for(load(args.config), args.token_file, scope=scope)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, f"{args.scheduler}{path}", json=body, headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise SystemExit(f"cellflip jobs: cannot reach {args.scheduler}: {e}") from None
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text[:200]
        raise SystemExit(f"cellflip jobs {args.action}: {args.scheduler} answered {r.status_code}: {detail}")
    return r.json()


def settings_of(text: str | None) -> dict:
    """`--settings`: a JSON object (SystemExit with one line otherwise; nothing was sent)."""
    try:
        out = json.loads(text) if text else {}
    except ValueError as e:
        raise SystemExit(f"cellflip jobs: --settings is not JSON: {e}") from None
    if not isinstance(out, dict):
        raise SystemExit(f"cellflip jobs: --settings must be a JSON object, got {text}")
    return out


def cmd_jobs(args) -> int:
    action = args.action or "list"
    args.action = action
    if action == "create":
        body = {"name": args.name, "model": args.model, "min_cells": args.min_cells, "max_cells": args.max_cells,
                "weight": args.weight, "settings": settings_of(args.settings)}
        out = _call(args, "POST", "/v1/jobs", body)
    elif action == "set":
        out = _call(args, "PATCH", f"/v1/jobs/{args.name}", {"settings": settings_of(args.settings)})
    elif action == "delete":
        out = _call(args, "DELETE", f"/v1/jobs/{args.name}")
    elif action == "move":
        out = _call(args, "POST", f"/v1/jobs/{args.job}/cells", {"cell": args.cell})
    else:
        out = _call(args, "GET", "/v1/jobs")
        print(table(rows_of(out["jobs"])))
        for m in out.get("moves", [])[:5]:
            print(f"move {m['id']}: {m['cell']} {m['from']} -> {m['to']} {m['state']}")
        if args.json:
            print(json.dumps(out))
        return 0
    print(json.dumps(out), file=sys.stdout)
    return 0


def add_parsers(sub) -> None:
    jb = sub.add_parser("jobs", help="the RL jobs: list (cells, versions, demand), create, delete, move a cell")
    jb.set_defaults(func=cmd_jobs)
    jb_sub = jb.add_subparsers(dest="action")
    jb_list = jb_sub.add_parser("list", help="each job with its cells, versions and demand (the default)")
    jb_list.add_argument("--json", action="store_true")
    cr = jb_sub.add_parser("create", help="create a job (admin token)")
    cr.add_argument("name")
    cr.add_argument("--model", required=True, help="a model preset or a Hugging Face path, or `fleet` (the cells' own); a cell serves only jobs of its model")
    cr.add_argument("--min-cells", type=int, default=0)
    cr.add_argument("--max-cells", type=int)
    cr.add_argument("--weight", type=float, default=1.0)
    cr.add_argument("--settings", help="JSON object: objective, staleness_bound, staleness_policy, min_rollout_cells, "
                                       "max_sessions, drain_s, seed, task")
    st = jb_sub.add_parser("set", help="change a job's settings (admin token; null: back to the fleet's default)")
    st.add_argument("name")
    st.add_argument("--settings", required=True, help='JSON object, e.g. {"min_rollout_cells": 2}')
    dl = jb_sub.add_parser("delete", help="drain a job, then delete it (admin token)")
    dl.add_argument("name")
    mv = jb_sub.add_parser("move", help="move a cell into a job (admin token)")
    mv.add_argument("cell")
    mv.add_argument("job")
    for p in (jb, *jb_sub.choices.values()):  # before or after the action; after it only when given
        keep = {} if p is jb else {"default": argparse.SUPPRESS}
        p.add_argument("--scheduler", **(keep or {"default": "http://127.0.0.1:8700"}))
        p.add_argument("--config", help="the scheduler's config (where its token file is)", **keep)
        p.add_argument("--token-file", help="file holding the token (default: the scope's variable, else the "
                                            "scheduler's generated file beside its store)", **keep)
    jb.set_defaults(json=False)

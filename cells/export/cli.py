"""`cellflip export`, `cellflip replay` and `cellflip export-weights` (the parsers and their
commands; cells/cli.py adds them). The exporter is a process of its own talking to the
scheduler's REST API with a reader token (least privilege: it reads finished trajectories and
acknowledges what it wrote, and can change nothing the trainer or the cells see)."""

from __future__ import annotations

import json
import signal
import sys
import threading


def _token(args, scope: str) -> str | None:
    from scheduler.contract.config import CellflipConfig, ConfigError, load_config
    from scheduler.contract.tokens import client_token

    try:
        cfg = load_config(args.config) if args.config else CellflipConfig()
        return client_token(cfg.scheduler, args.token_file, scope=scope)
    except ConfigError as e:
        raise SystemExit(f"cellflip {args.cmd}: {e}") from None


def cmd_export(args) -> int:
    """Finished trajectories to DIR (parts + manifest); `--follow` keeps going until SIGINT or
    SIGTERM, each session written exactly once across restarts."""
    from cells.export.run import run_export, summary
    from cells.export.source import ExportError, ExportSource
    from cells.export.writer import ExportDir

    config = {"scheduler": args.scheduler, "format": args.format, "job": args.job, "since": args.since,
              "part_rows": args.part_rows}
    try:
        out = ExportDir(args.out, args.format, config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"cellflip export: {e}") from None
    src = ExportSource(args.scheduler, _token(args, "reader"))
    stop = threading.Event()
    saved = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stats = run_export(src, out, since=args.since, job=args.job, follow=args.follow, part_rows=args.part_rows,
                           poll_s=args.poll_s, stop=stop)
        result = summary(stats, out)
        if args.weights or args.weights_from:
            from cells.export.weights import collect

            result["weights"] = collect(src, out, args.weights_from or [], ask_cells=args.weights)
    except ExportError as e:
        raise SystemExit(f"cellflip export: {e}") from None
    finally:
        src.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    print(json.dumps(result))
    return 0


def cmd_replay(args) -> int:
    from cells.export.replay import replay
    from cells.export.writer import verify

    try:
        problems = verify(args.dir)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"cellflip replay: {args.dir} is not an export directory: {e}") from None
    if problems:
        raise SystemExit("cellflip replay: " + "; ".join(problems))
    serve = "gateway" if args.serve else "direct" if args.serve_direct else None
    print(json.dumps(replay(args.dir, tile=args.row_tile, serve=serve)))
    return 0


def cmd_export_weights(args) -> int:
    """`cellflip export-weights VERSION DIR`: a cell holding the version writes it as a Hugging
    Face directory at DIR below its `cells.export_root`; waits for its answer."""
    import time

    import httpx

    token = _token(args, "trainer")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=args.scheduler, headers=headers, timeout=10.0) as http:
            r = http.post(f"/v1/versions/{args.version}/exports", json={"path": args.dir, "dtype": args.dtype})
            if r.status_code != 202:
                try:
                    detail = r.json().get("detail")
                except ValueError:
                    detail = r.text[:200]
                raise SystemExit(f"cellflip export-weights: {args.scheduler} answered {r.status_code}: {detail}")
            ex = r.json()
            print(f"export {ex['id']}: version {args.version} from {ex['cell']}", file=sys.stderr)
            deadline = time.monotonic() + args.timeout
            while ex["state"] == "pending" and time.monotonic() < deadline:
                time.sleep(0.5)
                ex = http.get(f"/v1/exports/{ex['id']}").json()
    except httpx.HTTPError as e:
        raise SystemExit(f"cellflip export-weights: cannot reach {args.scheduler}: {e}") from None
    if ex["state"] != "done":
        raise SystemExit(f"cellflip export-weights: {ex['state']}: {ex.get('reason') or 'no answer in time'}")
    print(ex["written_to"])
    return 0


def _client_args(p, scope_help: str) -> None:
    p.add_argument("--scheduler", default="http://127.0.0.1:8700")
    p.add_argument("--config", help="the scheduler's config (where its token file is)")
    p.add_argument("--token-file", help=scope_help)


def add_parsers(sub) -> None:
    ex = sub.add_parser("export", help="write finished trajectories (with provenance) to a directory")
    ex.add_argument("--out", required=True, help="the export directory (parts + manifest.json)")
    ex.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ex.add_argument("--since", type=int, default=0, help="start after this finish number (a cursor)")
    ex.add_argument("--follow", action="store_true", help="keep exporting as sessions finish (until SIGINT)")
    ex.add_argument("--job", help="only this job's sessions (the session id's prefix before the first '-')")
    ex.add_argument("--weights", action="store_true",
                    help="bring the rows' weight versions to DIR/weights/v<N> (cells write the ones they hold: "
                         "needs a trainer or admin token), or name where they are")
    ex.add_argument("--weights-from", action="append", metavar="DIR",
                    help="a directory holding v<N> Hugging Face exports to copy from (repeatable)")
    ex.add_argument("--part-rows", type=int, default=4096, help="rows per part file")
    ex.add_argument("--poll-s", type=float, default=2.0, help="--follow: seconds between looks")
    _client_args(ex, "file holding a reader token (default: $CELLFLIP_READER_TOKEN, else the scheduler's "
                     "generated runs/reader.token)")
    ex.set_defaults(func=cmd_export)
    rp = sub.add_parser("replay", help="re-score (and --serve: re-sample) an export from the directory alone")
    rp.add_argument("dir")
    rp.add_argument("--serve", action="store_true", help="also sample each turn again with its id and seed, "
                    "through a throwaway scheduler's gateway and one cell per version")
    rp.add_argument("--serve-direct", action="store_true", help="the same on an in-process engine (no gateway)")
    rp.add_argument("--row-tile", type=int, default=4, help="the cells' engine row_tile (batch-invariant numerics)")
    rp.set_defaults(func=cmd_replay)
    ew = sub.add_parser("export-weights", help="write a weight version as a Hugging Face directory (a cell "
                                               "holding it writes it below its cells.export_root)")
    ew.add_argument("version", type=int)
    ew.add_argument("dir", help="relative to the cells' export root (runs/exports by default)")
    ew.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ew.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the cell's answer")
    _client_args(ew, "file holding a trainer or admin token")
    ew.set_defaults(func=cmd_export_weights)

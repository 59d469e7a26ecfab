"""The trajectory export: a real small run exported and replayed, then a store of many sessions
replicating that run's rows exported through the scheduler's REST API by a separate process.

1. A real run: scheduler + 3 embedded cells (batch-invariant, the toy model), the trainer and
   its agents for `STEPS` RL steps, every version exported by a cell holding it
   (`trainer.export_every: 1`). Then, in fresh processes: `cellflip export --weights-from`
   (reader token) and `cellflip replay --serve`.
2. A store of `sessions` finished sessions replicating the run's exported rows whose every
   sampled token was scored (scheduler/store/replicate.py), served by the real app under uvicorn in this process (its
   control loop ticking every 0.2 s), exported to parquet by `cellflip export` in a subprocess.

Fields:
- sessions, tokens: the replicated store's finished sessions and their tokens.
- tokens_per_s: tokens exported ÷ the exporter's CPU seconds in its export loop (one core: it
  is single-threaded); tokens_per_s_process: ÷ the whole process's CPU seconds (interpreter
  start-up and imports too); tokens_per_s_wall: ÷ its wall time (the scheduler's paced reads
  included: one stream takes at most a quarter of the scheduler's event loop).
- bytes_per_token: on-disk bytes of the token ids, both log-probs, version and mask columns ÷
  tokens (parquet metadata, compressed); bytes_per_token_all: the whole files ÷ tokens;
  bytes_per_token_real: the whole files of the real run's own export ÷ its tokens (no
  replication to help the compressor).
- tick_p99_ratio_during_export: p99 of the control loop's tick period (start to start, what
  the export can delay) while exporting ÷ without; tick_duration_p99_ms_idle / _export: the
  tick's own duration.
- replay_exact_frac, control_match_frac, replay_serve_identical_frac (and the moved ones):
  `cellflip replay --serve` on the real run's export (docs/EXPORT.md); real_sessions its rows.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import finish, parse_args, set_threads

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2


def _cli(*args: str, timeout: float = 900) -> tuple[dict, float, float]:
    """A `cellflip` command in a fresh process: its last JSON line, wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "cells.cli", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env={**{k: v for k, v in os.environ.items() if not k.startswith("CELLFLIP_")},
                                      "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"cellflip {args[0]} failed: {p.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(p.stdout.strip().splitlines()[-1]), wall, cpu


def real_run(tmp: Path) -> dict:
    """The real run, its export (with its versions' weights) and replay."""
    from cells.localcluster import Cluster
    from cells.trainer.toy_task import TOY_RENDERER
    from cells.trainer.trainer import Trainer
    from scheduler.contract.config import parse_config

    raw = {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 10.0, "heartbeat_s": 0.25, "min_rollout_cells": 1,
                      "drain_deadline_s": 60.0},
        "cells": {"count": 3, "export_root": str(tmp / "exports"),
                  "engine": {"type": "embedded", "model": {"preset": "toy"}, "num_blocks": 1024, "block_size": 16,
                             "max_running": 8, "batch_invariant": True}},
        "gateway": {"renderer": TOY_RENDERER},
        "trainer": {"enabled": True, "steps": STEPS, "seed": 0, "checkpoint_dir": None, "batch_episodes": 32,
                    "agents": 8, "group_size": 4, "train_cells": 1, "export_every": 1},
    }
    c = Cluster(tmp, num_cells=3, cfg=raw, ready_timeout_s=300)
    try:
        Trainer(parse_config(raw), c.url, run_dir=tmp, tag="real", token=c.trainer_token,
                agent_token=c.agent_token).run()
        (tmp / "reader.token").write_text(c.tokens["reader"])
        out = tmp / "export"
        _cli("export", "--out", str(out), "--scheduler", c.url, "--token-file", str(tmp / "reader.token"),
             "--weights-from", str(tmp / "exports"))
    finally:
        c.stop()
    replay, wall, _ = _cli("replay", str(out), "--serve")
    m = json.loads((out / "manifest.json").read_text())
    replay.update(real_sessions=m["rows"], real_tokens=m["tokens"], replay_wall_s=round(wall, 1),
                  bytes_per_token_real=round(sum(p["bytes"] for p in m["parts"]) / max(1, m["tokens"]), 3),
                  weights={v: w["state"] for v, w in (m.get("weights") or {}).items()})
    return {"dir": out, **replay}


class TickClock:
    """Each tick's start and duration, from the controller's own loop."""

    def __init__(self, ctl) -> None:
        self.starts: list[float] = []
        self.durations: list[float] = []
        inner = ctl.tick

        def tick() -> None:
            t0 = time.perf_counter()
            inner()
            self.starts.append(t0)
            self.durations.append(time.perf_counter() - t0)
        ctl.tick = tick

    def mark(self) -> int:
        return len(self.starts)

    def p99(self, lo: int, hi: int) -> tuple[float, float]:
        """p99 of the tick period and of the tick duration over ticks [lo, hi)."""
        periods = sorted(b - a for a, b in zip(self.starts[lo:hi - 1], self.starts[lo + 1:hi]))
        durs = sorted(self.durations[lo:hi])
        pick = lambda xs: xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")  # noqa: E731
        return pick(periods), pick(durs)


def _serve(db: Path):
    """The real app on this store under uvicorn in a thread (its loop ticking); (url, server, app)."""
    import uvicorn

    from cells.localcluster import find_free_port
    from scheduler.api.app import create_app
    from scheduler.contract.config import CellflipConfig
    from scheduler.contract.config.scheduler import SchedulerConfig

    cfg = CellflipConfig(scheduler=SchedulerConfig(db_path=str(db), auth="none", store={
        "retain_trajectories": {"count": None}}))
    app = create_app(cfg, db_path=str(db))
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, app


def big_export(tmp: Path, templates: list[dict], sessions: int, idle_s: float) -> dict:
    from scheduler.store import Store
    from scheduler.store.replicate import replicate

    db = tmp / "big.sqlite"
    store = Store(db)
    tokens = replicate(store, templates, sessions)
    store.close()
    url, server, app = _serve(db)
    try:
        clock = TickClock(app.state.controller)
        time.sleep(2.0)  # the loop settles
        a = clock.mark()
        time.sleep(idle_s)
        b = clock.mark()
        res, wall, cpu = _cli("export", "--out", str(tmp / "big"), "--scheduler", url)
        c = clock.mark()
    finally:
        server.should_exit = True
    idle_period, idle_dur = clock.p99(a, b)
    exp_period, exp_dur = clock.p99(b, c)
    m = json.loads((tmp / "big" / "manifest.json").read_text())
    return {"sessions": m["rows"], "tokens": m["tokens"], "tokens_replicated": tokens,
            "tokens_per_s": round(m["tokens"] / res["cpu_s"]), "tokens_per_s_process": round(m["tokens"] / cpu),
            "tokens_per_s_wall": round(m["tokens"] / wall), "export_wall_s": round(wall, 2),
            "export_cpu_s": res["cpu_s"], "export_process_cpu_s": round(cpu, 2),
            "bytes_per_token": round(_core_bytes(tmp / "big") / m["tokens"], 3),
            "bytes_per_token_all": round(sum(p["bytes"] for p in m["parts"]) / m["tokens"], 3),
            "tick_p99_ratio_during_export": round(exp_period / idle_period, 3),
            "tick_period_p99_ms_idle": round(idle_period * 1e3, 2), "tick_period_p99_ms_export": round(exp_period * 1e3, 2),
            "tick_duration_p99_ms_idle": round(idle_dur * 1e3, 3), "tick_duration_p99_ms_export": round(exp_dur * 1e3, 3),
            "ticks_during_export": c - b, "rows_written": res["rows_written"]}


CORE = ("token_ids", "loss_mask", "logprob", "old_logprob", "version")


def _core_bytes(out: Path) -> int:
    """Compressed bytes of the token ids, both log-probs, version and mask columns."""
    import pyarrow.parquet as pq

    total = 0
    for f in (out / "data").glob("*.parquet"):
        meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for i in range(rg.num_columns):
                col = rg.column(i)
                if col.path_in_schema.split(".")[0] in CORE:
                    total += col.total_compressed_size
    return total


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    set_threads(1)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-export-"))
    real = real_run(tmp / "real")
    from cells.export.writer import read_rows

    rows = read_rows(real.pop("dir"))
    # a store of trained trajectories: every sampled token scored (the run's last sessions, not
    # scored yet when it stopped, would leave the log-prob service a backlog no store of trained
    # trajectories has, and the tick would measure that)
    templates = [r for r in rows if all(p for p, m in zip(r["old_provenance"], r["loss_mask"]) if m)] or rows
    sessions = 10_000 if args.quick else 100_000
    real.pop("sessions")  # the real run's rows: real_sessions
    result = {**big_export(tmp, templates, sessions, idle_s=10.0 if args.quick else 30.0), **real}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    finish(result, args, "export")


if __name__ == "__main__":
    main()

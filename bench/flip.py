"""Flip a cell holding long in-flight rollouts: live KV migration vs abort and re-prefill.

A cell holds REQUESTS requests of CONTEXT tokens each, decoding. It is flipped to training
(a) with live KV migration and (b), in the same invocation on a fresh cluster with the same
seed, by aborting and re-prefilling them on the other cells (what systems without live
migration do: `migration.path: reprefill`). Both are timed from the flip request until every
request is decoding again, as its client sees it: the first token that reaches the client
after the request stopped on the source: for (a) the stop-and-copy instant from the source's
migration record; for (b) the token that ends the longest silence after the flip (the source
was aborted and the destination re-prefilled).

Each way is flipped REPEATS times, each on a fresh cluster (same seed), alternating the two
ways so that drift on a shared machine hits both alike; `flip_live_s` and
`flip_abort_reprefill_s` are the medians, `ratio` their quotient, `repeats` the count, and
`flip_live_all_s` / `flip_abort_reprefill_all_s` every sample.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import finish, parse_args, set_threads

from cells.localcluster import Cluster, Streamer

MAX_TOKENS = 2048
REPEATS = 3


def make_cfg(tmp: Path, path: str) -> dict:
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 60.0, "min_rollout_cells": 1,
                      "drain_deadline_s": 300.0},
        "cells": {"count": 3, "engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 1400,
                                         "block_size": 16, "max_running": 8, "prefill_chunk": 2048}},
        "migration": {"transfer_timeout_s": 60.0, "path": path},
    }


def run(path: str, n: int, context: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"cellflip-flip-{path}-"))
    log = tmp / "migrations.jsonl"
    env = {i: {"CELLFLIP_MIGRATION_LOG": str(log)} for i in range(3)}
    c = Cluster(tmp, num_cells=3, cfg=make_cfg(tmp, path), cell_env=env, ready_timeout_s=300)
    try:
        for cell in ("cell-1", "cell-2"):  # every request lands on cell-0
            assert c.wait_flip(c.flip(cell, "training")["id"], 120)["state"] == "done"
        rng = random.Random(0)
        streams = [Streamer(c.url, [rng.randrange(8000) for _ in range(context)], MAX_TOKENS, seed=i, timeout_s=900, token=c.agent_token)
                   for i in range(n)]
        for s in streams:
            s.start()
        c.wait(lambda: all(len(s.tokens) >= 4 for s in streams), 900, "all requests decoding", every=0.01)
        for cell in ("cell-1", "cell-2"):
            assert c.wait_flip(c.flip(cell, "rollout")["id"], 120)["state"] == "done"
        assert all(len(s.tokens) < MAX_TOKENS for s in streams), "requests finished before the flip"
        t_flip = time.time()
        flip = c.wait_flip(c.flip("cell-0", "training")["id"], 900)
        for s in streams:
            s.join(900)
        lost = sum(1 for s in streams if s.error or len(s.tokens) != MAX_TOKENS)
        stops = {}
        if log.exists():
            for line in log.read_text().splitlines():
                r = json.loads(line)
                if r["role"] == "source" and r["result"] == "committed":
                    stops[r["request_id"]] = r["marks"]["stopped"]
        resumed = []
        for s in streams:
            after = [t for t in s.wall_times if t > t_flip]
            if s.request_id in stops:
                resumed.append(min(t for t in after if t > stops[s.request_id]) - t_flip)
            else:
                gaps = [(b - a, b) for a, b in zip([t_flip, *after], after)]
                resumed.append(max(gaps)[1] - t_flip)
        return {"seconds": max(resumed), "lost": lost, "flip": flip}
    finally:
        c.stop()


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    n, context = 2, 8192
    lives, aborts = [], []
    for _ in range(REPEATS):
        lives.append(run("auto", n, context))
        aborts.append(run("reprefill", n, context))
    live_s = statistics.median(r["seconds"] for r in lives)
    abort_s = statistics.median(r["seconds"] for r in aborts)
    finish({
        "requests": n,
        "context_tokens": context,
        "repeats": REPEATS,
        "flip_live_s": round(live_s, 3),
        "flip_abort_reprefill_s": round(abort_s, 3),
        "ratio": round(live_s / abort_s, 4),
        "flip_live_all_s": [round(r["seconds"], 3) for r in lives],
        "flip_abort_reprefill_all_s": [round(r["seconds"], 3) for r in aborts],
        "lost": sum(r["lost"] for r in lives + aborts),
        "migrated": min(r["flip"]["migrated"] for r in lives),  # per flip (the fewest of the repeats)
        "recomputed": min(r["flip"]["recomputed"] for r in aborts),
    }, args, "flip")


if __name__ == "__main__":
    main()

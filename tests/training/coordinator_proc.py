"""A training coordinator in its own process, for the SIGKILL test: it resumes at the newest
commit the cells or its checkpoint hold, runs RL updates up to `--steps` on the given cells,
records every version it commits (before anything else happens), checkpoints each through a
cell, and writes the final committed parameters (read from a cell's checkpoint).

    python -m tests.training.coordinator_proc --store HOST:PORT --checkpoint DIR --out DIR --cells a,b --steps N
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cells.training.resume import find_committed
from cells.transport.store import StoreAddress
from scheduler.contract.failpoints import failpoint
from tests.training.cluster import committed_params, coordinator, learner, trajectories


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", required=True)
    ap.add_argument("--steps", type=int, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out, cells, ckpt = Path(a.out), a.cells.split(","), Path(a.checkpoint)
    host, port = a.store.rsplit(":", 1)
    batches = [trajectories(learner(), seed=s) for s in range(a.steps)]  # the same in every incarnation
    coord = coordinator(learner(), StoreAddress(host, int(port)), timeout_s=15, ack_timeout_s=15)
    found = find_committed(coord.store, cells, ckpt, wait_s=5)
    if found is not None:
        coord.adopt(*found)
    metrics = []
    while coord.version < a.steps:
        m = coord.update(batches[coord.version], cells, next_version=lambda: coord.version + 1)
        with open(out / "committed.jsonl", "a") as f:  # on disk before anything else happens
            f.write(json.dumps({"version": coord.version}) + "\n")
        metrics.append(m)
        failpoint("training.after_commit")  # the trainer dying before its checkpoint is written
        coord.checkpoint_done(coord.checkpoint(str(ckpt)), str(ckpt), 60)
    params = committed_params(coord, out / f"final-{len(metrics)}")
    torch.save(params, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"metrics": metrics, "resumed": found is not None and found[0]["version"],
                                                 "from_cells": bool(found and found[1])}))


if __name__ == "__main__":
    main()

"""A training coordinator in its own process, for the SIGKILL test: it resumes from a
checkpoint, runs one RL update on the given cells and records every version number it takes
(before using it) and its final state.

    python -m tests.training.coordinator_proc --store HOST:PORT --checkpoint PATH --out DIR --cells a,b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cells.training.coordinator import TrainingCoordinator
from cells.training.wire import weights_checksum
from cells.transport.store import StoreAddress
from tests.training.cluster import learner, trajectories


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    host, port = a.store.rsplit(":", 1)
    batch = trajectories(learner(), seed=5)  # the step's batch: the same in every incarnation
    lrn = learner(seed=1)
    lrn.load_state_dict(torch.load(a.checkpoint, weights_only=True))

    def next_version() -> int:
        with open(out / "published.jsonl", "a") as f:  # on disk before it is used
            f.write(json.dumps({"version": lrn.version}) + "\n")
        return lrn.version

    coord = TrainingCoordinator(lrn, StoreAddress(host, int(port)), timeout_s=15, ack_timeout_s=15)
    m = coord.update(batch, a.cells.split(","), next_version=next_version)
    torch.save({k: p.detach() for k, p in lrn.params.items()}, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"metrics": m, "checksum": weights_checksum(
        {k: p.detach() for k, p in lrn.params.items()})}))


if __name__ == "__main__":
    main()

"""The processes of a cell's training ranks 1..S-1 (`cells.train_ranks`), started and stopped by
its rank 0 (each runs `python -m cells.training.cell_ranks`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

from cells.transport.store import StoreAddress

FAILPOINTS_RANK = "CELLFLIP_FAILPOINTS_RANK_"
"""`CELLFLIP_FAILPOINTS_RANK_<i>`: the failpoints of the cell's rank i alone (its rank 0's
`CELLFLIP_FAILPOINTS` otherwise go to every rank), taken once: a restarted rank runs clean."""


def rank_device(device: str | torch.device, i: int) -> str:
    """Rank i's device on the cell's device kind: `cuda:<i>` on a GPU cell, else the same."""
    d = torch.device(device)
    return f"cuda:{i}" if d.type == "cuda" else str(d)


class Followers:
    """The processes of ranks 1..S-1 of one cell, for one coordinator store: started by rank
    0 when it connects, restarted when the store's address changes, killed on close."""

    def __init__(self, w: Any, source: StoreAddress) -> None:
        self.source, self.procs = source, []
        for i in range(1, w.cell_size):
            args = [sys.executable, "-m", "cells.training.cell_ranks", "--store", f"{source.host}:{source.port}",
                    "--cell-id", w.cell_id, "--cell-rank", str(i), "--cell-ranks", str(w.cell_size),
                    "--device", rank_device(w.device, i), "--parent", str(os.getpid())]
            if w.local_loss:
                args += ["--loss", w.local_loss]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            if f"{FAILPOINTS_RANK}{i}" in env:  # fault injection into one rank of the cell, once
                env["CELLFLIP_FAILPOINTS"] = os.environ.pop(f"{FAILPOINTS_RANK}{i}")
                env.pop(f"{FAILPOINTS_RANK}{i}")
            self.procs.append(subprocess.Popen(args, env=env))

    @classmethod
    def ensure(cls, current: Followers | None, w: Any, source: StoreAddress) -> Followers:
        if current is not None and current.source == source and all(p.poll() is None for p in current.procs):
            return current
        if current is not None:
            current.stop()
        return cls(w, source)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

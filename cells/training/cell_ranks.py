"""A cell's training ranks 1..S-1 (`cells.train_ranks: S`): processes its rank 0 starts, one per
further rank, each a `TrainingWorker` of the same cell id with its own index. They follow the
coordinator's assignments of the cell and hold their slices of the state
(cells/training/sharded.py); rank 0 speaks for the cell. On a GPU node rank i is meant for
`cuda:<i>` (`rank_device`): the gathered layout's slices live there and its groups are NCCL;
the flat layout's learner is host tensors over gloo (docs/TRAINING.md).

    python -m cells.training.cell_ranks --store HOST:PORT --cell-id ID --cell-rank I --cell-ranks S
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import Any

import torch

from cells.transport.store import StoreAddress


def main(argv: list[str] | None = None) -> None:
    from cells.training.worker import TrainingWorker

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--cell-id", required=True)
    p.add_argument("--cell-rank", type=int, required=True)
    p.add_argument("--cell-ranks", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--loss", default=None)
    p.add_argument("--parent", type=int, default=None, help="rank 0's pid (this rank exits when it is gone)")
    a = p.parse_args(argv)
    if not 0 < a.cell_rank < a.cell_ranks:
        p.error(f"--cell-rank must be in 1..{a.cell_ranks - 1}")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {a.cell_id}.{a.cell_rank} %(name)s %(message)s")
    host, port = a.store.rsplit(":", 1)
    w = TrainingWorker(a.cell_id, device=a.device, local_loss=a.loss, cell_rank=a.cell_rank, cell_size=a.cell_ranks)
    w.source = StoreAddress(host, int(port))
    w.enter()
    parent = a.parent if a.parent is not None else os.getppid()
    threading.Thread(target=_orphaned, args=(parent, w), name="parent-watch", daemon=True).start()
    w._loop()


def _orphaned(parent: int, w: Any) -> None:
    """Rank 0 gone (killed, or its cell restarted): this rank goes too, its slices with it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    logging.getLogger("cellflip.training").warning("cell %s rank %d: rank 0 is gone; exiting",
                                                   w.cell_id, w.cell_rank)
    os._exit(0)


if __name__ == "__main__":
    main()

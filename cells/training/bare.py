"""A bare training rank (no engine, no scheduler) for tests and benches, with two requests a
bench makes of a cell besides training: receive a version broadcast, and load a version back
for rollout the way `CellVersions` does (its own committed copy if it computed it, else a
fetch), reporting the bytes received and the weights' checksum.

    python -m cells.training.bare --store HOST:PORT --cell-id ID
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import torch

from cells.training.wire import weights_checksum
from cells.training.worker import TrainingWorker
from cells.transport.receive import fetch_version, receive_broadcast
from cells.transport.store import StoreAddress, connect, get_json, set_json

log = logging.getLogger("cellflip.training")


def request_key(cell_id: str, n: int) -> str:
    return f"train/bare/{cell_id}/req/{n}"


def reply_key(cell_id: str, n: int) -> str:
    return f"train/bare/{cell_id}/reply/{n}"


def serve_requests(w: TrainingWorker, address: StoreAddress, stop: threading.Event) -> None:
    """Answer numbered requests: {"op": "broadcast"|"load", "version": v, "namespace": where the
    publishing cell's host rendezvouses} or {"op": "flip"}."""
    store, n = connect(address, timeout_s=30.0), 1
    while not stop.is_set():
        if not store.check([request_key(w.cell_id, n)]):
            time.sleep(0.02)
            continue
        req = get_json(store, request_key(w.cell_id, n))
        t0 = time.perf_counter()
        if req["op"] == "flip":  # back to rollout and into training again, as a cell's flips do
            w.leave()
            w.enter()
            set_json(store, reply_key(w.cell_id, n), {"mode": "flip"})
            n += 1
            continue
        if req["op"] == "broadcast":
            got = receive_broadcast(address, w.cell_id, int(req["version"]), timeout_s=60.0,
                                    namespace=req.get("namespace", "versions"))
            tensors, mode = got.tensors, "broadcast"
        else:
            tensors, mode = w.weights_for(int(req["version"])), "local"
            if tensors is None:
                tensors, mode = fetch_version(address, w.cell_id, int(req["version"]), timeout_s=60.0,
                                              namespace=req.get("namespace", "versions")), "fetch"
        nbytes = 0 if mode == "local" or tensors is None else sum(t.numel() * t.element_size() for t in tensors.values())
        set_json(store, reply_key(w.cell_id, n), {
            "mode": mode, "bytes": nbytes, "seconds": time.perf_counter() - t0,
            "checksum": None if tensors is None else weights_checksum(tensors)})
        n += 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the coordinator's store")
    p.add_argument("--cell-id", required=True)
    p.add_argument("--loss", default=None, help="the custom loss this rank may import (trainer.objective.loss)")
    p.add_argument("--ranks", type=int, default=1, help="training ranks of this cell (cells.train_ranks)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host, port = args.store.rsplit(":", 1)
    w = TrainingWorker(args.cell_id, local_loss=args.loss, cell_size=args.ranks)
    w.source = StoreAddress(host, int(port))
    w.enter()
    stop = threading.Event()
    threading.Thread(target=serve_requests, args=(w, w.source, stop), daemon=True, name="bare").start()
    threading.Thread(target=w._beat, name="training-beat", daemon=True).start()
    w._loop()


if __name__ == "__main__":
    main()

"""The raw link reference for the migration bench, measured inside two serving cells.

A migration's KV sends are timed from the instant the source begins a send (the destination
has posted its receive) to the instant the destination has the bytes, with the copy rounds
pausing decoding on both ends (`quiesce`). The reference here does the same with plain
tensors over its own pair channel between the same two processes, while they serve: the
same message sizes, the same start and end points, the same pause. Only the migration's own
work (exports, imports, headers, the engine lock) is left out, which is what the ratio of
the two measures.

The bench drives it through files, JSON only: it writes ``probe-N.json`` (``{"reps":
[[bytes, ...], ...], "warmup": bool}``) into the probe directory; both cells run it; rank 0
writes ``probe-N.out.json`` (``{"reps": [[[start, end], ...], ...]}``, wall-clock instants).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

from cells.transport.p2p import PairChannel, TransferError
from cells.transport.store import StoreAddress, StoreHost, connect

log = logging.getLogger("cellflip.probe")

POLL_S = 0.02


class LinkProbe:
    """One side of the probe: joins the pair channel at construction (both cells, before
    they serve), then runs each request file the bench drops, on a thread."""

    def __init__(self, spec: dict, *, connect_timeout_s: float = 120.0) -> None:
        self.rank, self.dir = int(spec["rank"]), Path(spec["dir"])
        port = int(spec["port"])
        if self.rank == 0:
            self._host = StoreHost("127.0.0.1", port)
            store = self._host.store
        else:
            store = connect(StoreAddress("127.0.0.1", port), timeout_s=connect_timeout_s)
        self.ch = PairChannel(store, "link-probe", self.rank, timeout_s=connect_timeout_s,
                              connect_timeout_s=connect_timeout_s)
        self._buf = torch.ones(0, dtype=torch.uint8)

    def start(self, quiesce, stop: threading.Event) -> None:
        """Serve requests on a thread until `stop`; each message is sent under `quiesce()`,
        as a copy round is."""
        threading.Thread(target=self._serve, args=(quiesce, stop), name="link-probe", daemon=True).start()

    def _serve(self, quiesce, stop: threading.Event) -> None:
        seq = 0
        while not stop.is_set():
            path = self.dir / f"probe-{seq}.json"
            if not path.exists():
                time.sleep(POLL_S)
                continue
            try:
                spec = json.loads(path.read_text())
                if spec.get("warmup"):  # untimed: first touches of the path
                    self._rep(spec["reps"][0], quiesce)
                reps = [self._rep(sizes, quiesce) for sizes in spec["reps"]]
            except (TransferError, OSError, ValueError, KeyError) as e:
                log.warning("link probe %d failed: %s", seq, e)
                reps = None
            if self.rank == 0:
                out = self.dir / f"probe-{seq}.out.json"
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps({"reps": reps, "error": None if reps is not None else "failed"}))
                os.replace(tmp, out)
            if reps is None:
                return
            seq += 1

    def _rep(self, sizes: list[int], quiesce) -> list[list[float]]:
        """Rank 0 sends each size to rank 1; returns `[start, end]` per message (rank 0's
        send start, rank 1's receive end)."""
        need = max(sizes, default=0)
        if self._buf.numel() < need:
            self._buf = torch.ones(need, dtype=torch.uint8)  # warm: written once, reused
        quiesce = quiesce or contextlib.nullcontext
        starts, ends = [], []
        for n in sizes:
            if self.rank == 0:
                if not self.ch.recv_json().get("ready"):
                    raise TransferError("peer not ready")
                with quiesce():
                    starts.append(time.time())
                    self.ch.send_tensor(self._buf[:n])
            else:
                with quiesce():
                    pending = self.ch.irecv(self._buf[:n])
                    self.ch.send_json({"ready": True})
                    pending.wait()
                    ends.append(time.time())
        if self.rank == 1:
            self.ch.send_json({"ends": ends})
            return []
        ends = self.ch.recv_json()["ends"]
        return [[s, e] for s, e in zip(starts, ends)]

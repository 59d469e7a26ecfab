"""Training on cells: step time on 1 and 2 training cells, parity, join and flip-back costs.

    python bench/train.py [--quick] [--json]

This process is the coordinator (a `Learner` with the `tiny` preset and a `VersionHost`, as
the trainer holds them); three spawned bare training ranks (`cells.training.bare`, one torch
thread each, no engine, no rollout load) are the cells. The batch is the e2e RL step's:
64 trajectories in groups of 8 (32 with --quick), synthetic token ids over the preset's output
vocabulary, exact old log-probs; two minibatches per update, grad-norm clipping on, the e2e
learning rate.

Run A: cell 0 alone, updates u1..u3 (u1 includes its join). Run B: a fresh coordinator state
(the same initial weights), cells 0 and 1, the same three batches. Each run starts once its
cells prepared a learner from the coordinator's skeleton (what a cell does between its flip
to training and the step boundary), so u2 and u3 are steady updates on both.
- step_s["1"], step_s["2"]: median coordinator-side wall time of u2 and u3 in runs A and B
  (plan, assignment, compute on the cells, the new state back to the host copy, commit).
- speedup_2 = step_s["1"] / step_s["2"].
- update_s: the same medians of rank 1's own `run_update` time (forwards, backwards, gradient
  sums, optimizer steps): the part of a step the cells split; the rest of step_s is the
  state's way back to the host copy, checksums and the commit.
- param_max_rel_diff: max over tensors of ||θ_A − θ_B|| / ||θ_A − θ_0|| after u3.
- coordinator_forward_s / coordinator_backward_s: seconds this process spent in RL forwards
  and backwards over both runs (the learner's own counters).
- join_s: cell 1 trains u4 and u5 with cell 0 (moments exist), flips to rollout, misses u6,
  and flips back for u7 on cells 0 and 1: the coordinator's time from u7's assignment until
  cell 1 confirmed that it rebuilt parameters, moments, reference and EWMA copy bitwise (its
  checksum of the whole state), every tensor of it overwritten. Cell 1's training memory
  stayed through its rollout stint, as on every cell whose engine does not take the memory
  back (`keep_memory`).
- join_prepared_s: the same for cell 2 joining u5, in the training role since the start (its
  learner prepared from the skeleton, never trained).
- join_cold_s: the same for a rank process started just before u6 (cells 0 and 3): its first
  stint, every tensor of the state allocated on the step's path (or by the learner it
  began preparing when it came up).
- broadcast_s: a version broadcast of the same model (`VersionHost.broadcast`) to cell 2, the
  receiver's time (join, buckets, CRC checks).
- loading_bytes: bytes cell 0 received loading the version of the last update it computed
  back for rollout (0: it installed its own copy); loaded_checksum_ok: the weights it would
  install have the published version's checksum.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, finish, parse_args, set_threads

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.learner import Learner
from cells.trainer.versions_host import VersionHost
from cells.training.bare import reply_key, request_key
from cells.training.coordinator import TrainingCoordinator
from cells.training.protocol import alive_key, prepared_key
from cells.training.wire import weights_checksum
from cells.transport.store import connect, set_json, wait_json, wait_keys

LR, MINIBATCHES = 1e-3, 2


def batch(spec, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out_ids = spec.output_ids()
    out = []
    for g in range(n // 8):
        prompt = [rng.choice(out_ids) for _ in range(rng.randrange(60, 120))]
        for i in range(8):
            comp = [rng.choice(out_ids) for _ in range(rng.randrange(20, 80))]
            ids, p = prompt + comp, len(prompt)
            m = [j >= p for j in range(len(ids))]
            out.append({"id": f"b{seed}-{g}-{i}", "reward": float(rng.random() < 0.5), "group_id": f"b{seed}-{g}",
                        "segment_starts": [0], "token_ids": ids, "loss_mask": [int(x) for x in m],
                        "logprobs": [-3.0 if x else None for x in m], "versions": [0 if x else None for x in m],
                        "old_logprobs": [-3.0 if x else None for x in m],
                        "provenance": ["exact" if x else None for x in m]})
    return out


def start_ranks(tmp: Path, address, n: int, first: int = 0) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    ids = range(first, first + n)
    procs = [subprocess.Popen([sys.executable, "-m", "cells.training.bare", "--store", f"{address.host}:{address.port}",
                              "--cell-id", f"cell-{i}"], env=env, stdout=open(tmp / f"cell-{i}.log", "w"),
                             stderr=subprocess.STDOUT) for i in ids]
    store = connect(address)
    if len(wait_keys(store, [alive_key(f"cell-{i}") for i in ids], 300)) < n:
        raise TimeoutError("training ranks did not start")
    return procs


def ask(store, cell: str, n: int, req: dict) -> dict:
    set_json(store, request_key(cell, n), req)
    got = wait_json(store, reply_key(cell, n), 300)
    if got is None:
        raise TimeoutError(f"{cell} did not answer {req}")
    return got


def run(host: VersionHost, w0: dict, batches: list, cells: list[str]) -> tuple[Learner, TrainingCoordinator, list]:
    spec = PRESETS["tiny"]
    lrn = Learner(spec, w0, lr=LR, minibatches=MINIBATCHES, tile=None)
    lrn.start_rl()
    coord = TrainingCoordinator(lrn, host.address, timeout_s=120, ack_timeout_s=60)
    # the cells prepare their learner from the skeleton the coordinator published, as a cell
    # does between its flip to training and the step: every update measured is a steady one
    store = connect(host.address)
    if len(wait_keys(store, [prepared_key(c) for c in cells], 300)) < len(cells):
        raise TimeoutError("training ranks did not prepare a learner")
    ms = [coord.update(b, cells, next_version=lambda: lrn.version) for b in batches]
    return lrn, coord, ms


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    spec = PRESETS["tiny"]
    w0 = init_weights(spec, 0, 0.02)
    batches = [batch(spec, 32 if args.quick else 64, s) for s in range(3)]
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-"))
    host = VersionHost("127.0.0.1", 0)
    host.start()
    procs = start_ranks(tmp, host.address, 3)
    store = connect(host.address)
    try:
        a, coord_a, ma = run(host, w0, batches, ["cell-0"])
        theta_a = {k: p.detach().clone() for k, p in a.params.items()}
        m4 = coord_a.update(batches[0], ["cell-0", "cell-1"], next_version=lambda: a.version)
        m5 = coord_a.update(batches[1], ["cell-0", "cell-1", "cell-2"], next_version=lambda: a.version)
        host.put(a.version, a.weights())
        load = ask(store, "cell-0", 1, {"op": "load", "version": a.version})
        loaded_ok = load["checksum"] == weights_checksum(a.weights())  # before u6 changes them
        t0 = time.perf_counter()
        bc_reply = [None]
        th = threading.Thread(target=lambda: bc_reply.__setitem__(0, ask(store, "cell-2", 1, {"op": "broadcast", "version": a.version})))
        th.start()
        host.broadcast(a.version, ["cell-2"])
        th.join()
        broadcast_wall = time.perf_counter() - t0
        ask(store, "cell-1", 1, {"op": "flip"})  # cell 1, which trained u4 and u5, goes to rollout
        procs += start_ranks(tmp, host.address, 1, first=3)  # a cell process in its first stint
        m6 = coord_a.update(batches[2], ["cell-0", "cell-3"], next_version=lambda: a.version)
        ask(store, "cell-1", 2, {"op": "flip"})  # ... and comes back: its state is a step behind
        m7 = coord_a.update(batches[0], ["cell-0", "cell-1"], next_version=lambda: a.version)
        b, _, mb = run(host, w0, batches, ["cell-0", "cell-1"])
    finally:
        for p in procs:
            p.kill()
        host.close()
    diff = 0.0
    for k in theta_a:
        den = float((theta_a[k] - w0[k]).norm())
        if den > 0:
            diff = max(diff, float((theta_a[k] - b.params[k].detach()).norm()) / den)
    s1 = statistics.median(m["train_wall_s"] for m in ma[1:])
    s2 = statistics.median(m["train_wall_s"] for m in mb[1:])
    result = {
        "model_params": sum(t.numel() for t in w0.values()),
        "global_batch_tokens": int(sum(len(t["token_ids"]) for t in batches[0])),
        "step_s": {"1": round(s1, 3), "2": round(s2, 3)},
        "speedup_2": round(s1 / s2, 3),
        "update_s": {"1": round(statistics.median(m["step_s"] for m in ma[1:]), 3),
                     "2": round(statistics.median(m["step_s"] for m in mb[1:]), 3)},
        "param_max_rel_diff": diff,
        "coordinator_forward_s": a.compute_s["forward"] + b.compute_s["forward"],
        "coordinator_backward_s": a.compute_s["backward"] + b.compute_s["backward"],
        "join_s": round(m7["join_s"], 3),
        "join_prepared_s": round(m5["join_s"], 3),
        "join_cold_s": round(m6["join_s"], 3),
        "broadcast_s": round(bc_reply[0]["seconds"], 3),
        "broadcast_wall_s": round(broadcast_wall, 3),
        "loading_bytes": load["bytes"],
        "loading_mode": load["mode"],
        "loaded_checksum_ok": loaded_ok,
        "join_cells_u7": m7["join_cells"],
        "train_cells": [m["train_cells"] for m in ma + [m4, m5, m6, m7] + mb],
    }
    finish(result, args, "train")


if __name__ == "__main__":
    main()

"""Training on cells: step time on 1 and 2 training cells, parity, joins, publishing, and what
passes through the trainer.

    python bench/train.py [--quick] [--json]

This process is the trainer's coordinator (cells/training/coordinator.py: hyper-parameters, a
rendezvous store, commit records; no learner, no weights); spawned bare training ranks
(`cells.training.bare`, one torch thread each, no engine) are the cells and build the start
weights themselves. The batch is the e2e RL step's: 64 trajectories in groups of 8 (32 with
--quick), synthetic token ids over the preset's output vocabulary; two minibatches per
update, grad-norm clipping on, the e2e learning rate.

Run A: cell 0 alone, updates u1..u3. Run B: a fresh coordinator, cells 0 and 1 with token
shares 1:2, the same three batches.
- step_s, speedup_2, update_s: medians of u2 and u3 (coordinator wall time; rank 1's update).
- param_max_rel_diff: max over tensors of ||θ_A − θ_B|| / ||θ_A − θ_0|| after u3 (θ read back
  from a checkpoint the cells wrote; one cell computes exactly one process's update).
- join_s (cell 1 back from a rollout stint a step behind: from a rank of the step),
  join_peer_s (cell 3, a fresh process, alone in a step: from a parked peer), broadcast_s.
- publish_root: who sent the published version's bytes (`cell`: the cell that computed it).
- trainer_state_bytes: tensor bytes this process sent or received through torch.distributed
  over the whole run; join_bytes_from_trainer: the same during the steps with joiners.
- pretrained_start_ok, export_roundtrip_bitwise, export_negative_ok, resume_exact: the model
  in and out (bench/train_checks.py).
- trainer_bytes_per_step, trainer_max_rss_bytes: JSON bytes this process wrote and read at the
  store per step, and its peak resident memory, each measured in a fresh process at the `toy`
  and `tiny` with toy's output ids (4.3x apart, identical batches); trainer_growth: the
  larger of the two ratios.
- A cell as S ranks, mixed precision, log-probs in chunks (bench/train_memory.py): 2 cells x 2
  ranks against one process (`toy`, three updates, cells' token shares 1:2, trees, KL in the
  loss, self-normalisation): ranks_per_cell, sharded_param_max_rel_diff (fp32),
  bf16_param_max_rel_diff (2 x 2 vs one process, both bf16) against bf16_vs_fp32_rel_diff (one
  process), rank_state_bytes (live tensors of one rank at rest) against 1.25 x 40 B x params / S,
  rank_peak_rss_bytes, memory_formula_error (cells/rl/memory.py at this size against a rank's
  peak over its baseline), logprob_peak_bytes (T = 8,192, the full 151,936-row output).
  The same 2 x 2 with `trainer.shard_layout: gathered` (GatheredLearner, no compute copy),
  judged too: gathered_param_max_rel_diff (fp32), gathered_bf16_param_max_rel_diff (its bf16
  gradient slice; against bf16_vs_fp32_rel_diff), gathered_rank_state_bytes (against the same
  budget), gathered_memory_formula_error (`memory.layer_gathered`, device and host terms).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import train_checks
import train_memory
from common import ROOT, finish, parse_args, set_threads

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.update import PROCESS_COMPUTE_S
from cells.training import jobs, state_files
from cells.training.bare import reply_key, request_key
from cells.training.coordinator import TrainingCoordinator
from cells.training.protocol import alive_key, prepared_key
from cells.training.wire import params_view
from cells.transport.p2p import TENSOR_BYTES
from cells.transport.store import JSON_BYTES, StoreHost, connect, set_json, wait_json, wait_keys

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


def coordinator(address, spec, lr: float = LR, start: dict | None = None):
    from cells.rl.objectives import ObjectiveConfig
    from cells.training import protocol as P

    # the trust-region guard off: this measures an update's parity, not the guard (a rejected
    # update leaves θ at θ_0, and the parity figure would compare nothing)
    hyper = P.hyper_of(spec, ObjectiveConfig(max_update_kl=None), lr=lr, minibatches=MINIBATCHES, tile=None,
                       temperature=1.0)
    return TrainingCoordinator(hyper, P.param_shapes(spec), address,
                               start=start or {"kind": "init", "seed": 0, "std": 0.02}, timeout_s=120, ack_timeout_s=60)


def run(address, spec, batches: list, cells: list[str], shares=None) -> tuple:
    coord = coordinator(address, spec)
    store = connect(address)  # the cells prepare a learner first, as between a flip and a step
    if len(wait_keys(store, [prepared_key(c) for c in cells], 300)) < len(cells):
        raise TimeoutError("training ranks did not prepare a learner")
    ms = [coord.update(b, cells, shares=shares, next_version=lambda: coord.version + 1) for b in batches]
    return coord, ms


def state_of(coord, path: Path) -> dict:
    r = coord.checkpoint_done(coord.checkpoint(str(path)), str(path), 300)
    if not r.get("ok"):
        raise RuntimeError(f"checkpoint failed: {r}")
    meta, flat, _ = state_files.load_packed(path)
    return {k: v.clone() for k, v in params_view(meta, flat).items()}


def publish(coord, cell: str, receiver: str, n: int) -> tuple[dict, dict, float]:
    """Version `coord.version` published by `cell` to `receiver` (a bare rank, asked to join
    the broadcast): the publisher's answer, the receiver's, the wall time."""
    store = coord.store
    put = jobs.wait(store, jobs.post(store, cell, {"op": "put", "version": coord.version, "live": []}), 120)
    if not put.get("ok"):
        raise RuntimeError(f"put failed: {put}")
    t0, box = time.perf_counter(), {}
    th = threading.Thread(target=lambda: box.setdefault("r", ask(store, receiver, n, {
        "op": "broadcast", "version": coord.version, "namespace": put["namespace"]})))
    th.start()
    sent = jobs.wait(store, jobs.post(store, cell, {"op": "broadcast", "version": coord.version,
                                                   "receivers": [receiver]}), 300)
    th.join()
    if not sent.get("ok") or receiver not in sent.get("delivered", []):
        raise RuntimeError(f"publish failed: {sent}")
    return sent, box["r"], time.perf_counter() - t0


def size_spec(name: str):
    """`toy` (9.8M parameters) and `tiny` with toy's output ids (42M): 4.3x apart, the same
    vocabulary and output ids, so the batches are identical to the byte."""
    if name == "toy":
        return PRESETS["toy"]
    return replace(PRESETS["tiny"], output_id_ranges=PRESETS["toy"].output_id_ranges)


def size_probe(preset: str, quick: bool) -> dict:
    """In a fresh process: two steps at `preset` on one cell; this process's store bytes per
    step and peak memory."""
    spec = size_spec(preset)
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-size-"))
    host = StoreHost("127.0.0.1", 0)
    procs = start_ranks(tmp, host.address, 1, first=9)
    try:
        batches = [batch(spec, 8, s) for s in range(3)]
        coord, _ = run(host.address, spec, batches[:1], ["cell-9"])
        before = dict(JSON_BYTES)
        for b in batches[1:]:
            coord.update(b, ["cell-9"], next_version=lambda: coord.version + 1)
        per_step = (sum(JSON_BYTES.values()) - sum(before.values())) / 2
    finally:
        for p in procs:
            p.kill()
        host.close()
    return {"bytes_per_step": per_step + sum(TENSOR_BYTES.values()) / 3,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def probe_sizes(quick: bool) -> dict:
    out = {}
    for preset in ("toy", "tiny"):
        r = subprocess.run([sys.executable, __file__, "--size-probe", preset] + (["--quick"] if quick else []),
                           capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"size probe {preset} failed: {r.stderr[-2000:]}")
        out[preset] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    args = parse_args(__doc__, lambda ap: (ap.add_argument("--size-probe", default=None),
                                           ap.add_argument("--logprob-probe", action="store_true")))
    set_threads(1)
    if args.logprob_probe:
        print(json.dumps(train_memory.logprob_probe()))
        return
    if args.size_probe:
        print(json.dumps(size_probe(args.size_probe, args.quick)))
        return
    sizes = probe_sizes(args.quick)
    memory = {**train_memory.sharded_figures(Path(tempfile.mkdtemp(prefix="cellflip-train-shard-"))),
              "logprob_peak_bytes": train_memory.run_probe("logprob")["logprob_peak_bytes"]}
    checks = {"pretrained_start_ok": train_checks.pretrained_start(start_ranks, coordinator, batch),
              **train_checks.export_roundtrip(start_ranks, coordinator, batch),
              **train_checks.resume_exact(start_ranks, coordinator, batch)}
    spec = PRESETS["tiny"]
    batches = [batch(spec, 32 if args.quick else 64, s) for s in range(3)]
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-"))
    host = StoreHost("127.0.0.1", 0)
    procs = start_ranks(tmp, host.address, 3)
    store = connect(host.address)
    try:
        coord_a, ma = run(host.address, spec, batches, ["cell-0"])
        theta_a = state_of(coord_a, tmp / "a")
        m4 = coord_a.update(batches[0], ["cell-0", "cell-1"], next_version=lambda: coord_a.version + 1)
        coord_a_checksum = coord_a.commit["checksum"]
        pub, got, pub_wall = publish(coord_a, "cell-0", "cell-2", 1)
        ask(store, "cell-1", 1, {"op": "flip"})  # cell 1, which trained u4, goes to rollout
        joins_before = sum(TENSOR_BYTES.values())
        m5 = coord_a.update(batches[1], ["cell-0"], next_version=lambda: coord_a.version + 1)
        ask(store, "cell-1", 2, {"op": "flip"})  # ... and comes back a step behind
        m6 = coord_a.update(batches[2], ["cell-0", "cell-1"], next_version=lambda: coord_a.version + 1)
        procs += start_ranks(tmp, host.address, 1, first=3)  # a fresh cell alone: from a parked peer
        m7 = coord_a.update(batches[0], ["cell-3"], next_version=lambda: coord_a.version + 1,
                            peers=["cell-0", "cell-1"])
        join_bytes = sum(TENSOR_BYTES.values()) - joins_before
        coord_b, mb = run(host.address, spec, batches, ["cell-0", "cell-1"], shares=[1.0, 2.0])
        theta_b = state_of(coord_b, tmp / "b")
    finally:
        for p in procs:
            p.kill()
        host.close()
    w0 = init_weights(spec, 0, 0.02)  # the start, for the relative difference (after the runs)
    diff, moved = 0.0, 0
    for k in theta_a:
        den = float((theta_a[k] - w0[k]).norm())
        if den > 0:
            moved += 1
            diff = max(diff, float((theta_a[k] - theta_b[k]).norm()) / den)
    if not moved:  # negative control: the updates must have moved the parameters
        raise RuntimeError("no parameter moved: the parity figure would compare nothing")
    s1 = statistics.median(m["train_wall_s"] for m in ma[1:])
    s2 = statistics.median(m["train_wall_s"] for m in mb[1:])
    bps = {k: v["bytes_per_step"] for k, v in sizes.items()}
    rss = {k: v["max_rss_bytes"] for k, v in sizes.items()}
    result = {
        "model_params": sum(t.numel() for t in w0.values()),
        "global_batch_tokens": int(sum(len(t["token_ids"]) for t in batches[0])),
        "step_s": {"1": round(s1, 3), "2": round(s2, 3)},
        "speedup_2": round(s1 / s2, 3),
        "update_s": {"1": round(statistics.median(m["step_s"] for m in ma[1:]), 3),
                     "2": round(statistics.median(m["step_s"] for m in mb[1:]), 3)},
        "param_max_rel_diff": diff, "params_moved": moved,
        "updates_rejected": int(sum(m.get("update_rejected", 0) for m in ma + mb)),
        "join_s": round(m6["join_s"], 3), "join_source_u6": m6["join_source"],
        "join_peer_s": round(m7["join_s"], 3), "join_source_u7": m7["join_source"],
        "broadcast_s": round(got["seconds"], 3), "broadcast_wall_s": round(pub_wall, 3),
        "broadcast_checksum_ok": got["checksum"] == coord_a_checksum,
        "publish_root": pub.get("root"),
        "trainer_state_bytes": sum(TENSOR_BYTES.values()),
        "join_bytes_from_trainer": join_bytes,
        "trainer_bytes_per_step": bps, "trainer_max_rss_bytes": rss,
        "trainer_growth": round(max(bps["tiny"] / bps["toy"], rss["tiny"] / rss["toy"]), 4),
        "trainer_compute_s": sum(PROCESS_COMPUTE_S.values()),
        **checks, **memory,
        "train_cells": [m["train_cells"] for m in ma + [m4, m5, m6, m7] + mb],
    }
    finish(result, args, "train")


if __name__ == "__main__":
    main()

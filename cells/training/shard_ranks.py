"""Bare sharded training ranks on one machine: C cells x S ranks over gloo on 127.0.0.1, the
harness of tests/training/test_shard.py and bench/train.py (no engine, no coordinator).

    python -m cells.training.shard_ranks --port P --rank R --cells C --ranks S --config JSON --out DIR

Rank R is rank R % S of cell R // S. Each update builds this step's cross-cell groups anew
(rank i of every cell: the replicate dimension's membership is per step), plans the batch over
the C x S ranks by `shares`, runs `run_update`, and after the last writes its figures to
DIR/rank<R>.json; the cell-0 rank 0 writes the parameters (DIR/params.safetensors). `--rank -1`:
one process with the one-rank `Learner` (the reference the sharded run is compared with).
Figures: live tensor bytes at rest (a gc sweep of unique storages), peak resident memory and
the resident memory before the learner was built.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS


def tree_batch(spec: Any, groups: int, seed: int) -> list[dict]:
    """Groups of 4 members over the spec's output ids; member 0 of each group forks after its
    prompt into 2 branch sessions (`sid`, `sid.b1`): one tree per group."""
    rng = random.Random(seed)
    ids = spec.output_ids()
    out = []
    for g in range(groups):
        prompt = [rng.choice(ids) for _ in range(rng.randrange(30, 60))]
        for i in range(5):
            sid = f"s{seed}-{g}-{0 if i < 2 else i}" + (".b1" if i == 1 else "")
            comp = [rng.choice(ids) for _ in range(rng.randrange(10, 40))]
            m = [0] * len(prompt) + [1] * len(comp)
            out.append({"id": sid, "group_id": f"g{seed}-{g}", "reward": float(rng.random() < 0.5),
                        "segment_starts": [0], "token_ids": prompt + comp, "loss_mask": m,
                        "logprobs": [-3.0 + 0.1 * rng.random() if x else None for x in m],
                        "old_logprobs": [-3.0 if x else None for x in m],
                        "versions": [0 if x else None for x in m], "provenance": ["exact" if x else None for x in m]})
    return out


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def live_tensor_bytes() -> int:
    """Bytes of every live tensor's storage, each storage once."""
    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def spec_of(cfg: dict) -> Any:
    """The preset, with `cfg["spec"]`'s overrides (e.g. a small vocabulary for a fast test)."""
    over = dict(cfg.get("spec") or {})
    if over.get("output_id_ranges"):
        over["output_id_ranges"] = tuple(tuple(r) for r in over["output_id_ranges"])
    return replace(PRESETS[cfg["preset"]], **over)


def _learner(cfg: dict, rank: int, groups: Any) -> Any:
    from cells.rl.learner import Learner
    from cells.rl.objectives import KLInLoss, ObjectiveConfig
    from cells.rl.precision import set_precision
    from cells.rl.shard import ShardedLearner
    from cells.rl.shard_gathered import GatheredLearner

    spec = spec_of(cfg)
    objective = ObjectiveConfig(max_update_kl=cfg.get("max_update_kl"), kl=KLInLoss(coef=cfg.get("kl_coef", 0.01)), self_normalize=True)
    kw = {"lr": cfg["lr"], "objective": objective, "tile": None, "minibatches": cfg["minibatches"]}
    weights = init_weights(spec, 0, 0.02)
    cls, at = ShardedLearner, {}
    if cfg.get("gather_layers"):
        cls, at = GatheredLearner, {"device": cfg.get("device", "cpu")}
    learner = Learner(spec, weights, **kw) if groups is None else cls(spec, weights, groups=groups, **kw, **at)
    if cfg.get("sft_undivided"):  # (the tests' negative control: S copies of the warm-up's gradient)
        learner.divide_same_batch = False
    set_precision(learner, cfg.get("precision", "fp32"))
    learner.pack = bool(cfg.get("pack", True))
    return learner


def _graph_tokens(share: Any, micro_batch: int) -> int:
    """An upper bound of the tokens in one backward's graph on this rank: its `micro_batch`
    longest rows, or its longest tree (the serialised tokens)."""
    from cells.rl.trees import members

    rows, trees = [], []
    for m in members(share.trajectories):
        lens = [len(share.trajectories[i]["token_ids"]) for i in m]
        if len(m) > 1:
            trees.append(sum(lens) - (len(m) - 1) * min(lens) // 2)
        else:
            rows += lens
    return max(sum(sorted(rows)[-micro_batch:]), max(trees, default=0))


def sft_demos(spec: Any, n: int = 6) -> list[tuple[list[int], list[int]]]:
    """Demonstrations over the spec's output ids: a prompt (not loss-masked), a completion."""
    rng, ids = random.Random(7), spec.output_ids()
    out = []
    for _ in range(n):
        prompt, comp = [rng.choice(ids) for _ in range(rng.randrange(4, 12))], [rng.choice(ids) for _ in range(9)]
        out.append((prompt + comp, [0] * len(prompt) + [1] * len(comp)))
    return out


def _warmup(learner: Any, spec: Any, cfg: dict) -> list[dict]:
    """`cfg["sft"]`'s supervised steps, every rank of a cell on the same demonstrations (as the
    worker's warm-up), then RL begins; each step's loss and gradient norm."""
    from cells.rl.sft import begin_rl

    demos, out = sft_demos(spec), []
    for _ in range(int(cfg["sft"]["steps"])):
        idx = torch.randint(len(demos), (int(cfg["sft"]["batch_size"]),), generator=learner.generator).tolist()
        m = learner.sft_step([demos[i] for i in idx])
        out.append({"loss": m["loss"], "grad_norm": m["grad_norm"]})
    begin_rl(learner)
    return out


def _checkpoint_roundtrip(learner: Any, rank: int, out: Path, distributed: bool) -> bool:
    """The learner's state written (the one-rank format; a sharded learner gathers it, the
    first rank writes), read back into it on every rank, and gathered again: the same tensors."""
    import torch.distributed as dist

    from cells.training import state_files

    state = learner.state_dict()
    if rank <= 0:
        state_files.save_state(out / "state", state)
    if distributed:
        dist.barrier()
    learner.load_state_dict(state_files.load_state(out / "state"))
    again = learner.state_dict()
    same = all(torch.equal(state[k][n], again[k][n]) for k in ("params", "reference") for n in state[k])
    same &= all(torch.equal(v, again["ewma"][n]) for n, v in state["ewma"].items())
    for i, st in state["optimizer"]["state"].items():
        same &= all(torch.equal(v, again["optimizer"]["state"][i][s]) for s, v in st.items())
    return bool(same and state["meta"] == again["meta"])


def _save(params: dict, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in params.items()}, str(path))


def run_rank(rank: int, cells: int, ranks: int, port: int, cfg: dict, out: Path) -> None:
    import torch.distributed as dist

    from cells.rl import guard
    from cells.rl.plan import plan_update
    from cells.rl.reduce import GroupReducer, LocalReducer
    from cells.rl.shard import ShardGroups
    from cells.rl.update import run_update

    torch.set_num_threads(1)
    world, timeout = cells * ranks, float(cfg.get("timeout_s", 120))
    groups, reducer, shares = None, LocalReducer(), [1.0]
    if rank >= 0:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        cell_groups = [dist.new_group([c * ranks + r for r in range(ranks)]) for c in range(cells)]
        groups = ShardGroups(cell_groups[rank // ranks], rank % ranks, ranks, timeout_s=timeout)
        reducer = GroupReducer(dist.distributed_c10d._get_default_group(), world, timeout)
        shares = [float(s) for s in cfg["shares"]]
    _learner({**cfg, "spec": {**(cfg.get("spec") or {}), "num_layers": 1}}, rank, None)  # imports, warm-up
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here
    base_rss = _status_bytes("VmRSS")
    phases = [("base", base_rss, base_rss)]
    learner = _learner(cfg, rank, groups)
    phases.append(("built", _status_bytes("VmHWM"), _status_bytes("VmRSS")))
    spec, steps, graph_tokens = spec_of(cfg), [], 0
    sft = _warmup(learner, spec, cfg) if cfg.get("sft") else []
    for u in range(cfg["updates"]):
        if rank < 0 and cfg.get("save_every"):  # one process: the parameters before each update (controls)
            _save(learner.params, out / f"params_u{u}.safetensors")
        if groups is not None:  # this step's replicate groups: rank i of every cell
            cross = [dist.new_group([c * ranks + r for c in range(cells)]) for r in range(ranks)]
            if not cfg.get("skip_cross"):  # (skipped: the tests' negative control)
                groups.cross, groups.cross_size = cross[rank % ranks], cells
        plan = plan_update(tree_batch(spec, cfg["groups"], u), learner.objective, cfg["minibatches"], shares,
                           version=learner.version)
        graph_tokens = max(graph_tokens, _graph_tokens(plan.shares[max(rank, 0)], learner.micro_batch))
        t0 = time.perf_counter()
        snap = guard.take(learner)  # kept, as a training rank keeps its start-of-update snapshot
        m = run_update(learner, plan.shares[max(rank, 0)], reducer, snapshot=snap)
        steps.append({"step_s": time.perf_counter() - t0, "num_trees": m["num_trees"], "loss": m["loss"],
                      "rejected": m["update_rejected"]})
        phases.append((f"u{u + 1}", _status_bytes("VmHWM"), _status_bytes("VmRSS")))
    result = {"rank": rank, "rank_state_bytes": live_tensor_bytes(), "rank_peak_rss_bytes": _status_bytes("VmHWM"),
              "base_rss_bytes": base_rss, "phases": phases, "graph_tokens": graph_tokens, "params": learner.num_params if groups else
              sum(p.numel() for p in learner.params.values()), "steps": steps, "sft": sft}
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("checkpoint"):
        result["reload_equal"] = _checkpoint_roundtrip(learner, rank, out, groups is not None)
    full = learner.full_params() if hasattr(learner, "full_params") else learner.params  # (a collective)
    if rank <= 0:
        _save(full, out / "params.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if groups is not None:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cells: int, ranks: int, cfg: dict, out: Path, timeout_s: float = 600.0) -> list[dict]:
    """Run C x S ranks (or one process: cells = ranks = 0) to the end; their figures. Kills
    only its own processes on a failure or timeout."""
    world = cells * ranks
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1",
                             "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    rank_ids = list(range(world)) if world else [-1]
    procs = [subprocess.Popen([sys.executable, "-m", "cells.training.shard_ranks", "--port", str(port), "--rank", str(r),
                               "--cells", str(cells), "--ranks", str(ranks), "--config", json.dumps(cfg),
                               "--out", str(out)], env=env, stderr=subprocess.PIPE) for r in rank_ids]
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"rank failed ({p.returncode}): {err.decode()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in rank_ids]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    for a in ("--port", "--rank", "--cells", "--ranks"):
        ap.add_argument(a, type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    run_rank(a.rank, a.cells, a.ranks, a.port, json.loads(a.config), Path(a.out))


if __name__ == "__main__":
    main()

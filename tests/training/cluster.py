"""Bare training ranks (no engine, no scheduler) in their own processes around an in-process
coordinator: what the parity, elastic and fault tests drive."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import ModelSpec
from cells.rl.learner import Learner
from cells.transport.store import StoreHost

ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=64, vocab_size=8192, max_position=512,
                 output_id_ranges=((0, 48), (8000, 8004)))
"""Vocabulary large enough for the row-sparse state and gradient paths."""
E2E_LR = 1e-3


def learner(seed: int = 0, **kw) -> Learner:
    kw.setdefault("lr", E2E_LR)
    kw.setdefault("minibatches", 2)
    return Learner(SPEC, init_weights(SPEC, seed, 0.1), **kw)


def trajectories(lrn: Learner, groups: int = 4, size: int = 3, seed: int = 0) -> list[dict]:
    """On-policy trajectories with exact old log-probs, uneven lengths, rewards in a group."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [8000] + [rng.randrange(48) for _ in range(rng.randrange(3, 9))]
        for i in range(size):
            comp = [rng.randrange(48) for _ in range(rng.randrange(2, 14))] + [8001]
            ids = prompt + comp
            lp = lrn.logprobs(ids).tolist()
            sampled = [j >= len(prompt) for j in range(len(ids))]
            out.append({
                "id": f"s{g}-{i}", "reward": float(rng.random() < 0.5) + 0.1 * i, "group_id": f"g{g}",
                "segment_starts": [0], "token_ids": ids, "loss_mask": [int(m) for m in sampled],
                "logprobs": [lp[j - 1] if m else None for j, m in enumerate(sampled)],
                "versions": [lrn.version if m else None for m in sampled],
                "old_logprobs": [lp[j - 1] if m else None for j, m in enumerate(sampled)],
                "provenance": ["exact" if m else None for m in sampled]})
    return out


START = {"kind": "init", "seed": 0, "std": 0.1}
"""What `learner()` starts from: the ranks build it themselves."""


def coordinator(lrn: Learner, address, **kw):
    """A coordinator for learners like `lrn` (its hyper-parameters; the ranks build `START`)."""
    from cells.training import protocol as P
    from cells.training.coordinator import TrainingCoordinator

    kw.setdefault("timeout_s", 30)
    kw.setdefault("ack_timeout_s", 30)
    return TrainingCoordinator(P.hyper(lrn), P.skeleton(lrn)["params"], address, start=START, **kw)


def committed_state(coord, path: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The committed state as a cell holding it writes it (a checkpoint job): no state ever
    passes through the coordinator, so tests read it this way."""
    from cells.training import state_files

    r = coord.checkpoint_done(coord.checkpoint(str(path)), str(path), 120)
    assert r.get("ok"), r
    return state_files.load_packed(path)


def committed_params(coord, path: Path) -> dict[str, torch.Tensor]:
    from cells.training.wire import params_view

    meta, flat, _ = committed_state(coord, path)
    return {k: v.clone() for k, v in params_view(meta, flat).items()}


class Ranks:
    """`n` bare training ranks polling `store`'s coordinator keys."""

    def __init__(self, tmp: Path, n: int, env: dict[int, dict] | None = None,
                 args: dict[int, list[str]] | None = None) -> None:
        self.host = StoreHost("127.0.0.1", 0)
        self.tmp, self.procs = Path(tmp), {}
        for i in range(n):
            self.start(f"cell-{i}", (env or {}).get(i), (args or {}).get(i, []))
        self.wait_ready(list(self.procs))

    def wait_ready(self, cells: list[str], timeout_s: float = 120.0) -> None:
        from cells.training.protocol import alive_key
        from cells.transport.store import wait_keys

        keys = [alive_key(c) for c in cells]
        if len(wait_keys(self.host.store, keys, timeout_s)) < len(keys):
            raise TimeoutError(f"training ranks not up within {timeout_s}s:\n{self.logs()}")

    def start(self, cell_id: str, env: dict | None = None, args: list[str] | None = None) -> None:
        a = self.host.address
        log = open(self.tmp / f"{cell_id}.log", "a")
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        self.procs[cell_id] = subprocess.Popen(
            [sys.executable, "-m", "cells.training.bare", "--store", f"{a.host}:{a.port}", "--cell-id", cell_id,
             *(args or [])],
            env=e, stdout=log, stderr=subprocess.STDOUT)

    def runs(self) -> int:
        """A fresh number per call (names of per-run files)."""
        self._runs = getattr(self, "_runs", 0) + 1
        return self._runs

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-2000:]}" for f in sorted(self.tmp.glob("cell-*.log")))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a − b|| / ||a − base||."""
    out = 0.0
    for k in a:
        den = float((a[k] - base[k]).norm())
        if den > 0:
            out = max(out, float((a[k] - b[k]).norm()) / den)
    return out

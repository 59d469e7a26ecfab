"""One training rank's slices of a sharded learner's state (cells/rl/shard.py) as one flat
float32 buffer plus a JSON manifest: what a joining rank receives from the same-index rank of
a cell that holds the state, and what each rank of a cell writes to its checkpoint shard.

The buffer is the rank's L = ceil(P / S) elements of, in order: the fp32 master parameters,
the KL reference, the PPO-EWMA copy, and (when the optimizer has stepped) AdamW's two moments.
The manifest carries the counters, the EWMA weight, the sampling generator and the layout
(P, S, the rank). Installing a slice leaves the compute copy stale (`stale_copy`): the cell's
ranks all-gather it before the next forward. `reshard` rebuilds a rank's slices from the S'
slices of another layout (a checkpoint written by cells of another `train_ranks`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

FORMAT = "cellflip-shard/1"
KINDS = ("master", "reference", "ewma", "exp_avg", "exp_avg_sq")


def pack_shard(learner: Any) -> tuple[dict[str, Any], Tensor]:
    """(manifest, values) of this rank's slices: a copy."""
    st = learner.optimizer.state.get(learner.master) or {}
    kinds = list(KINDS if "exp_avg" in st else KINDS[:3])
    parts = {"master": learner.master.detach(), "reference": learner.ref_shard,
             "ewma": learner.ewma.inner.params["shard"], "exp_avg": st.get("exp_avg"), "exp_avg_sq": st.get("exp_avg_sq")}
    flat = torch.cat([parts[k].detach().reshape(-1).to("cpu", torch.float32) for k in kinds])
    g = learner.groups
    meta = {"format": FORMAT, "num_params": learner.num_params, "shard_len": learner.shard_len,
            "cell_rank": g.cell_rank, "cell_size": g.cell_size, "kinds": kinds, "names": learner.names,
            "spec": json.dumps(learner.spec.signature(), sort_keys=True),
            "adam_step": float(st["step"]) if "step" in st else None,
            "ewma_weight": float(learner.ewma.inner.weight), "ewma_resets": int(learner.ewma.inner.num_resets),
            "version": int(learner.version), "step": int(learner.step), "cursor": int(learner.cursor),
            "rl_start_step": learner.rl_start_step, "rng": learner.generator.get_state().tolist()}
    return meta, flat


def _check(learner: Any, meta: dict[str, Any]) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a training-state shard ({meta.get('format')!r}): a cell of one rank holds "
                         "the whole state; give every cell the same cells.train_ranks")
    if list(meta["names"]) != learner.names or int(meta["num_params"]) != learner.num_params:
        raise ValueError("the shard's parameters differ from this learner's")
    if meta["spec"] != json.dumps(learner.spec.signature(), sort_keys=True):
        raise ValueError("the shard was written for another model spec")


@torch.no_grad()
def install_shard(learner: Any, meta: dict[str, Any], flat: Tensor) -> None:
    """This rank's slices (`pack_shard` of the same layout and rank) into `learner`; the
    compute copy is gathered later (`stale_copy`)."""
    _check(learner, meta)
    L, g = learner.shard_len, learner.groups
    if int(meta["shard_len"]) != L or int(meta["cell_rank"]) != g.cell_rank or int(meta["cell_size"]) != g.cell_size:
        raise ValueError(f"shard {meta['cell_rank']} of {meta['cell_size']} is not this rank's "
                         f"({g.cell_rank} of {g.cell_size})")
    parts = {k: flat[i * L: (i + 1) * L] for i, k in enumerate(meta["kinds"])}
    _set(learner, meta, parts)


def _set(learner: Any, meta: dict[str, Any], parts: dict[str, Tensor]) -> None:
    learner.master.detach().copy_(parts["master"])
    learner.ref_shard = learner._host_copy(parts["reference"])
    learner.ewma.inner.params = {"shard": learner._host_copy(parts["ewma"])}
    learner.ewma.inner.weight, learner.ewma.inner.num_resets = float(meta["ewma_weight"]), int(meta["ewma_resets"])
    learner.optimizer.state.pop(learner.master, None)
    if "exp_avg" in parts:
        dev = learner.master.device
        learner.optimizer.state[learner.master] = {
            "step": torch.tensor(float(meta["adam_step"]), dtype=torch.float32, device=dev),
            "exp_avg": parts["exp_avg"].to(dev, copy=True), "exp_avg_sq": parts["exp_avg_sq"].to(dev, copy=True)}
    learner.generator.set_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    learner.version, learner.step, learner.cursor = int(meta["version"]), int(meta["step"]), int(meta["cursor"])
    start = meta.get("rl_start_step")
    learner.rl_start_step = None if start is None else int(start)
    learner.stale_copy = True


@torch.no_grad()
def reshard(learner: Any, shards: list[tuple[dict[str, Any], Tensor]]) -> None:
    """This rank's slices rebuilt from every slice of another layout (S' shards, in rank
    order): each state buffer laid end to end, then cut at this rank's [lo, lo + L)."""
    if not shards:
        raise ValueError("no shard to rebuild the state from")
    for m, _ in shards:
        _check(learner, m)
    metas = [m for m, _ in shards]
    if [int(m["cell_rank"]) for m in metas] != list(range(int(metas[0]["cell_size"]))):
        raise ValueError("the shards do not cover one whole cell (ranks "
                         f"{[m['cell_rank'] for m in metas]} of {metas[0]['cell_size']})")
    if len({(m["version"], m["step"], tuple(m["kinds"])) for m in metas}) != 1:
        raise ValueError("the shards hold different states (versions or steps differ)")
    P, L, lo = learner.num_params, learner.shard_len, learner.lo
    parts = {}
    for i, k in enumerate(metas[0]["kinds"]):
        whole = torch.cat([f[i * int(m["shard_len"]): (i + 1) * int(m["shard_len"])] for m, f in shards])[:P]
        mine = torch.zeros(L)
        mine[: max(0, min(L, P - lo))] = whole[lo: lo + L]
        parts[k] = mine
    _set(learner, metas[0], parts)

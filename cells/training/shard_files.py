"""A sharded cell's checkpoint (cells.train_ranks > 1): each rank writes its slices
(`cells/rl/shard_state.py`) as its own state directory (safetensors plus a JSON manifest,
`state_files.save_state`) below `<root>/<sub>/rank-<i>`, then the cell's rank 0 writes the
root's index, `{"state": {"meta": {"sharded": S, "dir": sub}}, "commit": ...}`, which names
them. The index is written last and `LATEST` moves atomically, so a crash part way leaves the
previous checkpoint whole; the older shard directories go with the index that named them.

Read back: a cell of the same S reads each rank's own shard; another S re-shards (every
shard read, laid end to end, cut at the rank's slice); a one-rank checkpoint (the packed
whole state) is sliced. Shards of another commit than the index's are refused.

At Qwen3-32B on 8-GPU cells: 40 B/param / 8 = 164 GB per rank's shard file (master,
reference, EWMA 12 B; moments 8 B; ×32.8e9 / 8), 1.3 TB per checkpoint, written by all
eight ranks at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cells.rl.shard_state import install_shard, pack_shard, reshard
from cells.training import state_files
from cells.training.state_files import StateFileError


def sub_dir(job: dict[str, Any]) -> str:
    """The directory a checkpoint job's shards go in: unique per commit and job."""
    safe = "".join(c if c.isalnum() else "-" for c in f"{job['commit']['tag']}-{job['id']}")
    return f"shards-{safe}"


def write_shard(learner: Any, root: str, sub: str, commit: dict[str, Any]) -> None:
    """This rank's slices (a copy: nothing writes them meanwhile) below `root/sub`."""
    meta, flat = pack_shard(learner)
    write_packed(root, sub, meta, flat, commit)


def write_packed(root: str, sub: str, meta: dict[str, Any], flat, commit: dict[str, Any]) -> None:
    state_files.save_state(Path(root) / sub / f"rank-{meta['cell_rank']}",
                           {"shard": {"meta": meta, "values": flat}, "commit": commit})


def write_index(root: str, sub: str, ranks: int, commit: dict[str, Any]) -> None:
    state_files.save_state(root, {"state": {"meta": {"sharded": ranks, "dir": sub}}, "commit": commit},
                           keep=(sub,))


def _shard(root: str, sub: str, i: int, tag: str) -> tuple[dict[str, Any], Any]:
    st = state_files.load_state(Path(root) / sub / f"rank-{i}")
    if (st.get("commit") or {}).get("tag") != tag:
        raise StateFileError(f"shard {i} below {root} holds commit {(st.get('commit') or {}).get('tag')}, "
                             f"not the index's {tag}")
    return dict(st["shard"]["meta"]), st["shard"]["values"]


def load_into(learner: Any, root: str, hyper: dict[str, Any], local_loss: str | None) -> None:
    """The checkpoint below `root` into this rank's slices of `learner` (a `ShardedLearner`)."""
    top = state_files.load_state(root)
    state, tag = top["state"], (top.get("commit") or {}).get("tag")
    if "values" in state:  # a one-rank cell's packed state: rebuilt whole once, then sliced
        from cells.training import protocol as P
        from cells.training.join import set_extras
        from cells.training.wire import unpack

        meta, flat, idx = dict(state["meta"]), state["values"], state["rows"]
        one = P.build_learner(hyper, meta, flat, param_storage=flat, local_loss=local_loss)
        unpack(one, meta, flat, idx, held="fresh")
        set_extras(one, meta)
        learner.load_state_dict(one.state_dict())
        return
    S, sub, g = int(state["meta"]["sharded"]), state["meta"]["dir"], learner.groups
    if S == g.cell_size:
        install_shard(learner, *_shard(root, sub, g.cell_rank, tag))
    else:
        reshard(learner, [_shard(root, sub, i, tag) for i in range(S)])


def load_params(root: str, shapes: dict[str, Any]) -> dict[str, Any]:
    """The committed parameters of a sharded checkpoint (the master slices laid end to end),
    by name: what an export or a test reads without building a learner."""
    top = state_files.load_state(root)
    meta, tag = top["state"]["meta"], (top.get("commit") or {}).get("tag")
    if "sharded" not in meta:
        raise StateFileError(f"the state below {root} is not sharded")
    shards = [_shard(root, meta["dir"], i, tag) for i in range(int(meta["sharded"]))]
    flat = torch.cat([f[: int(m["shard_len"])] for m, f in shards])
    out, pos = {}, 0
    for k in sorted(shapes):
        n = 1
        for d in shapes[k]:
            n *= int(d)
        out[k] = flat[pos: pos + n].view(*shapes[k]).clone()
        pos += n
    return out

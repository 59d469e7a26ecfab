"""The per-token weights an update actually multiplied each token's objective by,
w_t = c_d(r_d) · min(r_stale, C_s) (0 where the token left the loss: MIS, the catastrophic
reject), kept per trajectory so the trainer can write them back (the export's
`train_weight`; docs/EXPORT.md).

One line: each minibatch's rows → `token_weights` with the minibatch's normaliser (the loss's
own call, cells/rl/objectives/ppo.py) → per trajectory, the weights of its loss-mask tokens
in buffer order → little-endian float32, base64 (JSON on the rendezvous store: never pickle).

A forked episode trains as one serialised tree whose loss counts (branch, token) pairs: each
branch session gets the weights of its own path's pairs at its own loss-mask tokens (the
shared prefix, sampled by branch 0, in branch 0's). A loss-mask token nothing trains (a
segment's first token, a branch the tree left out) is NaN.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import numpy as np
import torch

from cells.rl.batch import Batch
from cells.rl.objectives import token_weights


@torch.no_grad()
def keep(learner: Any, b: Batch | None, pre: dict[str, Any], rows: list[int], trees: list[int],
         normalizer: Any) -> None:
    """Record the weights of minibatch `rows` and `trees` as the loss computes them
    (`pre["used_w"]`, `pre["used_tree_w"]`)."""
    if b is None:
        return
    for i in trees:
        u, st = b.trees[i], pre["trees"][i]

        def per_branch(t, u=u):
            return t.unsqueeze(0).expand(u.num_branches, t.shape[0])

        w = token_weights(per_branch(st.lp_prox), per_branch(u.behav), u.mask, learner.objective,
                          lp_old=per_branch(u.old), provenance=per_branch(u.missing),
                          lp_stand=per_branch(st.lp_stand), normalizer=normalizer).weight
        pre.setdefault("used_tree_w", {})[i] = w.to(torch.float32)
    if not rows:
        return
    if "used_w" not in pre:
        pre["used_w"] = torch.full(b.mask.shape, float("nan"), dtype=torch.float32)
    idx = torch.tensor(rows)
    w = token_weights(pre["lp_prox"][idx], b.behav[idx], b.mask[idx], learner.objective, lp_old=b.old[idx],
                      provenance=b.missing[idx], lp_stand=pre["lp_stand"][idx], normalizer=normalizer).weight
    pre["used_w"][idx] = torch.where(b.mask[idx], w.to(torch.float32), float("nan"))


def per_trajectory(b: Batch | None, pre: dict[str, Any], trajectories: list[dict]) -> dict[str, str]:
    """Trajectory id → base64 of its loss-mask tokens' weights (float32, little-endian, in
    buffer order; NaN where no row trained the token)."""
    if b is None:
        return {}
    full: dict[int, np.ndarray] = {}

    def buffer(t: int) -> np.ndarray:
        if t not in full:
            full[t] = np.full(len(trajectories[t]["token_ids"]), np.nan, dtype=np.float32)
        return full[t]

    used = pre.get("used_w")
    for r in range(b.size if used is not None else 0):
        dst, n, a = buffer(int(b.traj[r])), len(b.ids[r]), b.starts[r]
        row = used[r, :n].numpy()
        dst[a:a + n] = np.where(np.isnan(row), dst[a:a + n], row)
    for i, w in (pre.get("used_tree_w") or {}).items():
        _tree(b.trees[i], w, trajectories, buffer)
    out = {}
    for t, w in full.items():
        tr = trajectories[t]
        out[str(tr["id"])] = encode(w[np.asarray(tr["loss_mask"], dtype=bool)])
    return out


def _tree(u: Any, w: torch.Tensor, trajectories: list[dict], buffer: Any) -> None:
    """Each kept branch's (branch, token) weights at its own buffer positions (a branch's path
    is its session's buffer from 0: position = depth)."""
    for k, t in enumerate(u.branch_trajs):
        idx = u.ser.branch_indices(k)
        pos = u.ser.positions[idx]
        ids = trajectories[t]["token_ids"]
        if int(pos.max()) >= len(ids) or u.ser.token_ids[idx].tolist() != [ids[p] for p in pos.tolist()]:
            continue  # not its buffer: left NaN rather than misplaced
        dst = buffer(t)
        keep_ = u.mask[k, idx]
        dst[pos[keep_].numpy()] = w[k, idx][keep_].numpy()


def encode(weights: np.ndarray) -> str:
    a = np.ascontiguousarray(weights, dtype="<f4")
    return base64.b64encode(a.tobytes()).decode()


def decode(text: str) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
    return a if sys.byteorder == "little" else a.astype(np.float32)

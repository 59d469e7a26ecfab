"""The per-token weights an update actually multiplied each token's objective by,
w_t = c_d(r_d) · min(r_stale, C_s) (0 where the token left the loss: MIS, the catastrophic
reject), kept per trajectory so the trainer can write them back (the export's
`train_weight`; docs/EXPORT.md).

One line: each minibatch's rows → `token_weights` with the minibatch's normaliser (the loss's
own call, cells/rl/objectives/ppo.py) → per trajectory, the weights of its loss-mask tokens
in buffer order → little-endian float32, base64 (JSON on the rendezvous store: never pickle).

A loss-mask token no row trains (a segment's first token, a forked episode's tree tokens, a
token past the staleness bound) is NaN.
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
def keep(learner: Any, b: Batch | None, pre: dict[str, Any], rows: list[int], normalizer: Any) -> None:
    """Record the weights of minibatch `rows` as the loss computes them (`pre["used_w"]`)."""
    if b is None or not rows:
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
    used = pre.get("used_w")
    if b is None or used is None:
        return {}
    full: dict[int, np.ndarray] = {}
    for r in range(b.size):
        t = int(b.traj[r])
        if t not in full:
            full[t] = np.full(len(trajectories[t]["token_ids"]), np.nan, dtype=np.float32)
        n, a = len(b.ids[r]), b.starts[r]
        row = used[r, :n].numpy()
        full[t][a:a + n] = np.where(np.isnan(row), full[t][a:a + n], row)
    out = {}
    for t, w in full.items():
        tr = trajectories[t]
        out[str(tr["id"])] = encode(w[np.asarray(tr["loss_mask"], dtype=bool)])
    return out


def encode(weights: np.ndarray) -> str:
    a = np.ascontiguousarray(weights, dtype="<f4")
    return base64.b64encode(a.tobytes()).decode()


def decode(text: str) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
    return a if sys.byteorder == "little" else a.astype(np.float32)

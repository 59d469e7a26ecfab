"""The update's trust-region guard: an RL update that moves the policy too far on its own batch
is rejected whole.

PPO's clip bounds the ratio only on tokens whose advantage pushes past it; one optimizer step
can still move the policy by nats on the rest (a rare large gradient through Adam's moments),
and one such step can undo an RL run. The guard measures what the update did, as the k3
estimate of KL(π_prox ‖ π) over the batch's kept tokens, reweighted from the sampling policy to
π_prox (`update_kl_terms`; π_prox: the parameters at the start of the update, the last
published version):

    during   the forward of minibatch j ≥ 1 (needed for its own loss) already measures the
             steps before it; past `max_update_kl` the update stops there;
    after    one detached forward over the batch measures the finished update
             (`update_kl`, the approximate KL between consecutive published policies).

Past the bound the update is rejected whole: parameters, optimizer moments, the EWMA copy and
the optimizer-step counter go back to the start of the update (a snapshot taken there), the
minibatches before the stop included (the choice: a step that ends past the trust region is no
evidence the earlier steps were sound). The version does not advance: the coordinator commits
the restored state under the version it started at and the trainer publishes nothing (no
number, no broadcast, no request restarted on any cell) and backs its learning rate off. The
rejection is counted (`update_rejected`), never silent. Every rank computes the same summed
KL, so every rank makes the same decision and the ranks' states stay equal.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cells.rl.batch import pad
from cells.rl.objectives import update_kl_terms
from cells.rl.reduce import Reducer
from cells.rl.tree_loss import approx_kl_sum


@dataclass
class Snapshot:
    """The learner state an update changes, as it was at its start."""

    params: dict[str, Tensor]
    moments: dict[str, dict[str, Tensor]]
    """AdamW's state by parameter name (absent: the parameter had none)."""
    ewma: dict[str, Tensor]
    ewma_weight: float
    ewma_resets: int
    step: int
    buffers: dict[str, dict[str, Tensor]]
    """Every moment tensor a snapshot of this learner allocated, kept for the next one (an
    update whose start had no moments is followed by one whose start has)."""


_WARM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each learner's last snapshot: the next one is copied into its tensors (an update's start
then copies memory that exists instead of faulting in five fresh model copies)."""


def take(learner: Any) -> Snapshot:
    """Copy the state an update changes (parameters, AdamW moments, EWMA, step counter), into
    the learner's previous snapshot's tensors where their shapes allow (it is obsolete once
    the next update starts)."""
    if hasattr(learner, "take_snapshot"):  # a sharded learner: its slices (cells/rl/shard.py)
        return learner.take_snapshot()
    prev = _WARM.get(learner)

    def keep(t: Tensor, old: Tensor | None) -> Tensor:
        # on an accelerator the copy lives in (pinned) host memory: at the real size it is
        # parameters, moments and the EWMA copy, 16 bytes a parameter (docs/RL.md)
        t = t.detach()
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            return old.copy_(t, non_blocking=t.is_cuda)
        if t.device.type == "cpu":
            return t.clone()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=t.is_cuda)

    params = {k: keep(p, prev and prev.params.get(k)) for k, p in learner.params.items()}
    buffers = dict(prev.buffers) if prev else {}
    moments = {}
    for k, p in learner.params.items():
        st = learner.optimizer.state.get(p)
        if st:
            was = buffers.get(k, {})
            moments[k] = buffers[k] = {s: keep(v, was.get(s)) for s, v in st.items()}
    ewma = {k: keep(v, prev and prev.ewma.get(k)) for k, v in learner.ewma.params.items()}
    if any(p.is_cuda for p in learner.params.values()):
        torch.cuda.synchronize()  # the host copies are complete before the update changes the state
    snap = Snapshot(params, moments, ewma, learner.ewma.weight, learner.ewma.num_resets, learner.step, buffers)
    _WARM[learner] = snap
    return snap


@torch.no_grad()
def restore(learner: Any, snap: Snapshot) -> None:
    """Put the learner back to `snap` (bitwise: copies, no arithmetic), into its own tensors."""
    if hasattr(learner, "restore_snapshot"):
        return learner.restore_snapshot(snap)
    state = learner.optimizer.state
    for k, p in learner.params.items():
        p.copy_(snap.params[k])
        p.grad = None
        saved, cur = snap.moments.get(k), state.get(p)
        if saved is None:
            state.pop(p, None)
        elif not cur or set(cur) != set(saved):
            state[p] = {s: v.to(p.device if v.dim() else v.device, copy=True) for s, v in saved.items()}
        else:
            for s, v in saved.items():
                cur[s].copy_(v)
    for k, v in snap.ewma.items():
        avg = learner.ewma.params.get(k)
        device = avg.device if avg is not None else learner.params[k].device if k in learner.params else v.device
        learner.ewma.params[k] = avg.copy_(v) if avg is not None and avg.shape == v.shape else v.to(device, copy=True)
    learner.ewma.weight = snap.ewma_weight
    learner.ewma.num_resets = snap.ewma_resets
    learner.step = snap.step


def minibatch_kl(sums: dict[str, float]) -> float:
    """KL(π_prox ‖ π) over a minibatch's tokens (the importance-weighted k3 mean), from its
    reduced metric sums."""
    return sums["approx_kl_sum"] / sums["approx_kl_weight"] if sums["approx_kl_weight"] else 0.0


@torch.no_grad()
def update_kl(learner: Any, b: Any, pre: dict, reducer: Reducer) -> float:
    """KL(π_prox ‖ π_now) over the batch's kept tokens (rows and trees, all ranks), by
    `update_kl_terms`: one detached forward at the current parameters."""
    acc = torch.zeros(2, dtype=torch.float64)
    cap = learner.objective.update_kl_is_cap
    if b is not None and b.size:
        for lo in range(0, b.size, learner.micro_batch):
            ids = b.ids[lo: lo + learner.micro_batch]
            lt = pad(learner.seq_logprobs(learner.params, ids, False)[0], b.length, 0.0)
            sl = slice(lo, lo + len(ids))
            acc += torch.tensor(update_kl_terms(pre["lp_prox"][sl], lt, b.behav[sl], b.mask[sl], cap),
                                dtype=torch.float64)
    for u, s in zip(b.trees if b is not None else [], pre["trees"]):
        lt, _, _ = learner.tree_logprobs(learner.params, u.ser, False)
        acc += torch.tensor(approx_kl_sum(u, s, lt, cap), dtype=torch.float64)
    join = getattr(learner, "join_forwards", None)  # a gathered learner's cell ends its forwards together
    if join is not None:
        join()
    reducer.all_reduce(acc)
    return float(acc[0] / acc[1]) if acc[1] > 0 else 0.0

"""A cell rank's learner without the compute copy: `ShardedLearner`'s slices, every forward on
layers gathered one at a time from them (cells/rl/layer_gather.py, cells/rl/layer_forward.py).

At rest a rank holds its slices only (master, moments, reference, EWMA, the guard's snapshot);
during a minibatch also its fp32 gradient slice, which the backward fills by reducing each
layer's gradient to its owners. The current parameters, the reference and the EWMA copy reach
`run_update` as stand-ins (`params` shapes on the meta device, `reference` / `ewma.params`
markers) that this learner's `seq_logprobs` / `tree_logprobs` turn into sources of slices.

The ranks of a cell run different numbers and kinds of forwards (their shares differ), and
each forward is a sequence of cell collectives in which every rank must gather the same state
(the owners broadcast their pieces of it): every forward starts with a handshake (an
all-reduce of the kind each rank wants: grad, parameters, reference, EWMA copy, or done); the
cell runs the lowest kind wanted, a rank wanting another runs an empty forward of that kind
and asks again; a rank done with a phase (`join_forwards`) serves the others' forwards so
until all are done (DDP's `Join`, for layer gathers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import AllreduceOptions, ReduceOp

from cells.rl.layer_forward import empty_forward, packed_logprobs, tree_logprobs
from cells.rl.layer_gather import FlatLayout, LayerGather, Source
from cells.rl.objectives.tree import SerializedTree
from cells.rl.shard import ShardedLearner, all_reduce
from cells.transport.p2p import wait_work

KINDS = ("grad", "params", "reference", "ewma")
"""The kinds of forward: at the parameters with and without grad, the reference, the EWMA copy."""


class _Which(dict):
    """The reference or the EWMA copy as `run_update` passes it: a name, no tensors."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which


class GatheredLearner(ShardedLearner):
    """`ShardedLearner` with the compute weights gathered a layer at a time (no `flat`).

    `device`: where the fp32 master slice, AdamW's moments, the gradient slice, the gathered
    units and the forwards live (`cuda:<local rank>` on a GPU cell); the reference, EWMA and
    snapshot slices stay in host memory (pinned on a GPU cell). Under `precision: bf16` the
    gradient slice is bf16 (the per-layer reduce's own dtype), cast to fp32 a chunk at a time
    in the optimizer step."""

    divide_same_batch = True
    """The warm-up's gradient divided by S (every rank ran the same demonstrations); False
    only in the tests' negative control."""

    def __init__(self, spec: Any, weights: dict[str, Tensor], *, groups: Any,
                 device: str | torch.device = "cpu", **kw: Any) -> None:
        self.device = torch.device(device)
        self.published: dict[str, Tensor] | None = None
        """The whole parameters as the cell's rank 0 last gathered them (`full_params`), for
        publishing the committed version; None after a restore (gathered again at a join)."""
        super().__init__(spec, weights, groups=groups, **kw)
        self._rope = tuple(t.to(self.device) for t in self._rope)

    def _init_state(self, weights: dict[str, Tensor], reference: dict[str, Tensor] | None, lr: float,
                    betas: tuple[float, float], weight_decay: float, storage: Tensor | None = None) -> None:
        g = self.groups
        self._settings(weights, lr, betas, weight_decay)
        self.params = {k: torch.empty(weights[k].shape, device="meta") for k in self.names}
        """Shapes only: the parameters live in the cell's slices."""
        self._layout = FlatLayout(dict(self._shapes), g.cell_size, g.cell_rank)
        self.num_params, self.shard_len = self._layout.num_params, self._layout.shard_len
        self.lo = g.cell_rank * self.shard_len
        self.flat, self.grad_slice = None, None
        self.master = self._slice_of(weights).to(self.device).requires_grad_(True)
        """This rank's slice of the fp32 parameters: the only copy."""
        self._slice_state(weights, reference, lr)
        if self.device.type == "cuda":
            self.ewma.inner.params["shard"] = self._host_copy(self.ewma.inner.params["shard"])

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient slice's dtype: the compute dtype (bf16 under `precision: bf16`), else fp32."""
        return self.compute_dtype or torch.float32

    def _new_grad(self) -> Tensor:
        return torch.zeros(self.shard_len, dtype=self.grad_dtype, device=self.master.device)

    # ShardedLearner's state with the slice as the only fp32 copy
    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        out = {}
        for k in self.names:
            o = self._layout.offsets[k]
            out[k] = flat[o: o + self.params[k].numel()].view(self.params[k].shape)
        return out

    @property
    def lg(self) -> LayerGather:
        return LayerGather(self.spec, self._layout, self.groups.cell, self.groups.timeout_s, dtype=self.compute_dtype)

    def _kind(self, weights: Any, grad: bool) -> int:
        """Which state a forward reads, as an index of `KINDS`."""
        if weights is self.params:
            return 0 if grad else 1
        if isinstance(weights, _Which) and not grad:
            return KINDS.index(weights.which)
        raise ValueError("a gathered learner computes on its own parameters, reference or EWMA copy only")

    def _kind_source(self, kind: int) -> Source:
        dev = self.master.device
        if kind == 0:
            if self.grad_slice is None:
                self.grad_slice = self._new_grad()
            return Source(self.master.detach(), self.grad_slice, dev)
        if kind == 1:
            return Source(self.master.detach(), None, dev)
        return Source(self.ref_shard if KINDS[kind] == "reference" else self.ewma.inner.params["shard"], None, dev)

    def gathered(self, which: str) -> dict[str, Tensor]:
        return _Which(which)

    # -- the forwards, in lockstep across the cell ------------------------------------------------
    def _round(self, want: int | None) -> int | None:
        """One handshake: each rank says which kind of forward it wants next (None: done with
        this phase). Returns the kind the cell runs now (the lowest wanted), None when all are
        done: every rank gathers the same state at the same time."""
        t = torch.zeros(len(KINDS) + 1, device=self.master.device)
        t[len(KINDS) if want is None else want] = 1.0
        if self.groups.cell_size > 1:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            wait_work(self.groups.cell.allreduce([t], opts), self.groups.timeout_s, "forward handshake")
        wanted = [i for i in range(len(KINDS)) if t[i].item() > 0]
        return wanted[0] if wanted else None

    def _lockstep(self, want: int) -> None:
        """Serve the cell's other forwards (empty ones of their kind) until it runs `want`."""
        while (kind := self._round(want)) != want:
            empty_forward(self.lg, self._kind_source(kind), grad=kind == 0)

    def join_forwards(self) -> None:
        """Done with this phase's forwards: serve the cell's others until they are done too
        (a grad forward's owners' sums reach `grad_slice`)."""
        while (kind := self._round(None)) is not None:
            empty_forward(self.lg, self._kind_source(kind), grad=kind == 0)

    def seq_logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool,
                     entropy: list | None = None) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        kind = self._kind(weights, grad)
        self._lockstep(kind)
        out = packed_logprobs(self.lg, self._kind_source(kind), list(seqs), grad=grad,
                              temperature=self.temperature, tile=self.tile, rope=self._rope, entropy=entropy)
        return out, {}, None

    def tree_logprobs(self, weights: dict[str, Tensor], tree: SerializedTree, grad: bool
                      ) -> tuple[Tensor, dict[str, Tensor], Tensor | None]:
        kind = self._kind(weights, grad)
        self._lockstep(kind)
        lp = tree_logprobs(self.lg, self._kind_source(kind), tree, tree.token_ids, grad=grad,
                           temperature=self.temperature, tile=self.tile, rope=self._rope)
        return lp, {}, None

    # -- the update's phases ----------------------------------------------------------------------
    def begin_update(self) -> None:
        """Nothing gathered whole: each forward gathers the slices it reads."""

    def drop_gathered(self) -> None:
        """The start-of-update forwards end here: in lockstep with the cell's other ranks."""
        self.join_forwards()

    def end_update(self) -> None:
        self.grad_slice = None
        self.master.grad = None

    def zero_grads(self) -> dict[str, Tensor]:
        self.grad_slice = self._new_grad()
        return {}

    def reduce_gradients(self, reducer: Any, touched: dict[str, Tensor]) -> None:
        """The cell's sum is in this rank's gradient slice already (reduced layer by layer):
        all-reduced among the same-index ranks of the step's cells, in its own dtype."""
        g = self.groups
        if self.grad_slice is None:
            self.grad_slice = self._new_grad()
        if g.cross is not None and g.cross_size > 1:
            all_reduce(g.cross, self.grad_slice, g.timeout_s, f"cross-cell all-reduce ({self.grad_slice.numel()} values)")

    def apply_gradients(self) -> float:
        """Clip by the global norm (a sum of squares over the cell's slices), AdamW on this
        rank's slice a chunk at a time (the gradient cast to fp32 per chunk: no fp32 copy of a
        bf16 gradient slice). Returns the norm before clipping."""
        g = self.groups
        grad = self.grad_slice if self.grad_slice is not None else self._new_grad()
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).double().square().reshape(1)
        norm = float(all_reduce(g.cell, sq, g.timeout_s, "gradient norm").sqrt())
        scale = 1.0 if self.max_grad_norm is None else min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.last_lr = self._base_lr * self.lr_scale()
        adamw_chunks(self.optimizer, self.master, grad, scale, self.last_lr)
        self.step += 1
        self.grad_slice = None
        return norm

    @torch.no_grad()
    def gather_params(self) -> None:
        """No compute copy to refresh: the slices are the parameters."""
        self.stale_copy = False

    def full_params(self, device: str | torch.device | None = "cpu") -> dict[str, Tensor]:
        """The whole fp32 parameters gathered unit by unit to `device` (publishing; every rank
        of the cell calls it: a collective). `device` None: take part, keep nothing."""
        return self.lg.gather_full(Source(self.master.detach(), None, self.master.device), device)

    def weights(self) -> dict[str, Tensor]:
        return self.full_params()

    @torch.no_grad()
    def _load_params(self, params: dict[str, Tensor]) -> None:
        self.master.detach().copy_(self._slice_of(params))

    @torch.no_grad()
    def restore_snapshot(self, snap: dict[str, Any], gather: bool = True) -> None:
        self.published = None
        self.grad_slice = None
        super().restore_snapshot(snap, gather)

    # -- the supervised warm-up -------------------------------------------------------------------
    def _logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool,
                  tile: int | None | str = "cells", entropy: list | None = None
                  ) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        """`Learner._logprobs` (the warm-up's and `logprobs`'s forwards) on gathered layers."""
        kind = self._kind(weights, grad)
        self._lockstep(kind)
        out = packed_logprobs(self.lg, self._kind_source(kind), list(seqs), grad=grad, temperature=self.temperature,
                              tile=self.tile if tile == "cells" else tile, rope=self._rope, entropy=entropy)
        return out, {}, None

    def sft_step(self, batch: Any) -> dict[str, float]:
        """`Learner.sft_step` with every rank of the cell running the same demonstrations (as
        the worker's warm-up does): the per-layer reduce sums S copies of the gradient, so
        the optimizer step divides it by S."""
        self.grad_slice = None
        return super().sft_step(batch)

    def _optimizer_step(self) -> float:
        self.join_forwards()
        if self.grad_slice is None:
            self.grad_slice = self._new_grad()
        if self.divide_same_batch:
            self.grad_slice.div_(self.groups.cell_size)
        self.reduce_gradients(None, {})
        norm = self.apply_gradients()
        self.version += 1
        return norm


def adamw_chunks(opt: torch.optim.Optimizer, master: Tensor, grad: Tensor, scale: float, lr: float,
                 chunk: int = 1 << 24) -> None:
    """`opt`'s fused AdamW step of `master` (its one parameter) at `lr` with `grad · scale`,
    `chunk` elements at a time: each chunk's gradient cast to fp32 on its own, so a bf16
    gradient slice never has a whole fp32 copy (64 MiB of fp32 at a time)."""
    from torch.optim.adam import adam

    group, st = opt.param_groups[0], opt.state[master]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(master.detach()), torch.zeros_like(master.detach())
    p, before, after = master.detach(), st["step"].clone(), None
    beta1, beta2 = group["betas"]
    for lo in range(0, p.numel(), chunk):
        hi, after = min(lo + chunk, p.numel()), before.clone()
        g = grad[lo:hi].to(torch.float32)
        if scale != 1.0:
            g = g * scale  # a copy: the gradient slice stays as reduced
        adam([p[lo:hi]], [g], [st["exp_avg"][lo:hi]], [st["exp_avg_sq"][lo:hi]], [], [after], fused=True,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
    if after is not None:
        st["step"] = after

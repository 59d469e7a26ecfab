"""A cell's training role as S ranks: the training state sharded S ways inside the cell, rank i
of each cell reducing with rank i of the step's other cells (hybrid sharded data parallel with
an elastic replicate dimension).

The choice: a flat-buffer ZeRO over the learner's own parameter storage, not FSDP2. The model
is a dict of tensors in one flat fp32 buffer (name order, `Learner(param_storage=...)`), so a
shard is a contiguous slice of it: rank r of a cell owns elements [r·L, (r+1)·L) of every
state buffer (L = ceil(P / S)). FSDP2 would need per-layer module wrappers around the dict and
its HSDP fixes the replicate group when `fully_shard` runs, so per-step membership needs the
`set_all_reduce_hook` detour; here the per-step group is just an argument (`ShardGroups.cross`).

Per rank, at rest: the fp32 compute copy of the parameters (whole: the forward reads it) and
1/S of everything else: the fp32 master slice (a view of the compute copy), AdamW's two
moments, the KL reference, the PPO-EWMA copy, and the guard's snapshot (master, moments,
EWMA). During an update: the whole gradient (one flat buffer), the reference and EWMA copy
gathered whole for the start-of-update forwards and dropped after them.

Per optimizer step: the gradient, one flat buffer, is reduce-scattered inside the cell (the
sum of the cell's ranks, slice r to rank r; gloo has no reduce-scatter: an all-reduce and the
slice), then all-reduced across the cells of this step among the ranks of the same index (in
bf16 with `precision: bf16`); the gradient norm is a sum of squares over the cell's slices;
AdamW steps the slice; the slices are all-gathered back into every rank's compute copy.

The vocabulary tables are sharded like every other tensor, by the flat layout (they are ~93%
of the toy model's parameters: any split that keeps them whole would leave one rank with
nearly all the state). Their moments are dense here, not row-sparse: with S ranks each holds
1/S of them, and the row-sparse saving of the one-rank path (cells/rl/reduce.py) is a wire
saving, which the in-cell reduce-scatter does not need (NVLink) and the cross-cell all-reduce
of 1/S of the table forgoes (measured in bench/train.py, not judged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import AllreduceOptions, ReduceOp

from cells.rl.learner import DEFAULT_STALENESS_BOUND, Learner
from cells.rl.objectives import PPOEWMA
from cells.rl.objectives.config import ewma_window
from cells.rl.shard_ckpt import SliceCheckpoints, all_gather
from cells.transport.p2p import wait_work


@dataclass
class ShardGroups:
    """Where a rank stands: its cell's group (fixed for the cell's life) and this step's group
    of same-index ranks across the step's cells (None: the cell trains alone)."""

    cell: Any
    cell_rank: int
    cell_size: int
    cross: Any = None
    cross_size: int = 1
    timeout_s: float = 120.0


def all_reduce(pg: Any, t: Tensor, timeout_s: float, what: str) -> Tensor:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    wait_work(pg.allreduce([t], opts), timeout_s, what)
    return t


def reduce_scatter(pg: Any, flat: Tensor, rank: int, n: int, timeout_s: float) -> Tensor:
    """This rank's slice [rank·n, (rank+1)·n) of the sum of `flat` over the group."""
    out = flat.new_empty(n)
    if flat.is_cuda:
        wait_work(pg._reduce_scatter_base(out, flat), timeout_s, f"reduce-scatter ({flat.numel()} values)")
        return out
    all_reduce(pg, flat, timeout_s, f"reduce-scatter as all-reduce ({flat.numel()} values)")
    return out.copy_(flat[rank * n: (rank + 1) * n])


class _ShardEWMA:
    """The learner's EWMA copy as `run_update` sees it: a slice kept here, the whole copy
    (`params`) only while an update gathered it."""

    def __init__(self, learner: ShardedLearner, inner: PPOEWMA) -> None:
        self.learner, self.inner = learner, inner

    @property
    def params(self) -> dict[str, Tensor]:
        return self.learner.gathered("ewma")

    def should_reset(self, num_missing_in_band: float, num_missing: float) -> bool:
        return self.inner.should_reset(num_missing_in_band, num_missing)

    def reset(self, params: Any = None) -> None:
        """Restart the average at the parameters (this rank's slice of them, in host memory)."""
        self.inner.reset({"shard": self.learner.master})
        self.inner.params["shard"] = self.learner._host_copy(self.inner.params["shard"])

    @property
    def num_resets(self) -> int:
        return self.inner.num_resets

    @num_resets.setter
    def num_resets(self, v: int) -> None:
        self.inner.num_resets = v

    @property
    def weight(self) -> float:
        return self.inner.weight


class ShardedLearner(SliceCheckpoints, Learner):
    """The learner of one of a cell's S training ranks (same arguments as `Learner`, plus
    `groups`); every rank of the cell builds it from the same start weights."""

    def __init__(self, spec: Any, weights: dict[str, Tensor], *, groups: ShardGroups, **kw: Any) -> None:
        self.groups = groups
        self._gathered: dict[str, dict[str, Tensor]] = {}
        self.flat_grad: Tensor | None = None
        self.solo_grads = False
        """Only the cell's rank 0 contributes its gradient (the supervised warm-up, where every
        rank of the cell runs the same demonstrations)."""
        self.stale_copy = False
        """The compute copy lags the slices (restored or installed without the cell's group):
        `gather_params` before a forward reads it."""
        super().__init__(spec, weights, **kw)

    # -- state ---------------------------------------------------------------------------------
    def _init_state(self, weights: dict[str, Tensor], reference: dict[str, Tensor] | None, lr: float,
                    betas: tuple[float, float], weight_decay: float, storage: Tensor | None = None) -> None:
        g = self.groups
        self._settings(weights, lr, betas, weight_decay)
        self.num_params = sum(weights[k].numel() for k in self.names)
        self.shard_len = -(-self.num_params // g.cell_size)
        self.lo = g.cell_rank * self.shard_len
        self.flat = torch.zeros(self.shard_len * g.cell_size)
        self.params = self._views(self.flat)
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(weights[k])
        for p in self.params.values():
            p.requires_grad_(True)
        self.master = self.flat[self.lo: self.lo + self.shard_len].requires_grad_(True)
        """This rank's slice of the fp32 parameters: a view of the compute copy."""
        self._slice_state(weights, reference, lr)

    def _settings(self, weights: dict[str, Tensor], lr: float, betas: tuple[float, float],
                  weight_decay: float) -> None:
        """The optimizer's settings and the parameters' names and shapes, before any storage."""
        self.betas, self.weight_decay, self._base_lr = betas, weight_decay, float(lr)
        self.compute_dtype, self.pack, self.checkpoint = None, True, False
        self.names = sorted(weights)
        self._shapes = {k: weights[k].shape for k in self.names}

    def _slice_state(self, weights: dict[str, Tensor], reference: dict[str, Tensor] | None, lr: float) -> None:
        """What lives beside `master`, slice for slice: the optimizer's moments, the reference
        and the EWMA copy."""
        self.optimizer = torch.optim.AdamW([self.master], lr=lr, betas=self.betas, weight_decay=self.weight_decay,
                                           fused=True)
        self.set_reference(reference if reference is not None else weights)
        ew = self.objective.ewma
        window = ewma_window(ew, DEFAULT_STALENESS_BOUND, self.minibatches)
        # from the weights' slice: the master's values, built in host memory (no device copy back)
        inner = PPOEWMA({"shard": self._slice_of(weights)}, staleness_window=window, reset_threshold=ew.reset_threshold)
        self.ewma = _ShardEWMA(self, inner)

    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        """Per-name views of a flat buffer in the parameters' layout."""
        out, pos = {}, 0
        for k in self.names:
            shape = self._shapes[k]
            out[k] = flat[pos: pos + shape.numel()].view(shape)
            pos += shape.numel()
        return out

    def _slice_of(self, weights: dict[str, Tensor]) -> Tensor:
        """This rank's slice of `weights` packed in the flat layout."""
        out, pos = torch.zeros(self.shard_len), 0
        lo, hi = self.lo, self.lo + self.shard_len
        for k in self.names:
            n = self.params[k].numel()
            a, b = max(pos, lo), min(pos + n, hi)
            if a < b:
                out[a - lo: b - lo] = weights[k].detach().reshape(-1)[a - pos: b - pos].to(torch.float32)
            pos += n
        return out

    def set_reference(self, weights: dict[str, Tensor] | None = None) -> None:
        """The KL reference's slice: of `weights`, or of the current parameters."""
        self.ref_shard = self._host_copy(self.master if weights is None else self._slice_of(weights))

    @property
    def reference(self) -> dict[str, Tensor]:
        return self.gathered("reference")

    def gathered(self, which: str) -> dict[str, Tensor]:
        if which not in self._gathered:
            raise RuntimeError(f"the {which} copy is gathered only during an update (begin_update)")
        return self._gathered[which]

    def begin_update(self) -> None:
        """Gather the reference and the EWMA copy whole for the start-of-update forwards (every
        rank of the cell calls it at the same point: a collective)."""
        g = self.groups
        for which, piece in (("reference", self.ref_shard), ("ewma", self.ewma.inner.params["shard"])):
            flat = torch.empty_like(self.flat)
            all_gather(g.cell, flat, piece.contiguous(), g.timeout_s)
            self._gathered[which] = self._views(flat)

    def drop_gathered(self) -> None:
        """The whole reference and EWMA copy are needed only by the start-of-update forwards."""
        self._gathered.clear()

    def end_update(self) -> None:
        """Drop the gathered copies and the whole gradient: at rest a rank holds its slices and
        the compute copy."""
        self._gathered.clear()
        self.flat_grad = None
        for p in self.params.values():
            p.grad = None
        self.master.grad = None

    # -- the optimizer step ----------------------------------------------------------------------
    def zero_grads(self) -> dict[str, Tensor]:
        """Zero gradients as views of one flat buffer (the reduce-scatter's input)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.flat)
        else:
            self.flat_grad.zero_()
        for k, v in self._views(self.flat_grad).items():
            self.params[k].grad = v
        return self._vocab.row_marks(self.params)

    def reduce_gradients(self, reducer: Any, touched: dict[str, Tensor]) -> None:
        """Sum the gradient over every rank of the step into this rank's slice: reduce-scatter
        in the cell, then all-reduce among the same-index ranks of the step's cells."""
        g = self.groups
        for k, v in self._views(self.flat_grad).items():
            p = self.params[k]
            if p.grad is not None and p.grad.data_ptr() != v.data_ptr():  # autograd replaced it
                v.copy_(p.grad)
        wire = self.flat_grad if self.compute_dtype is None else self.flat_grad.to(self.compute_dtype)
        shard = reduce_scatter(g.cell, wire, g.cell_rank, self.shard_len, g.timeout_s)
        if g.cross is not None and g.cross_size > 1:
            all_reduce(g.cross, shard, g.timeout_s, f"cross-cell all-reduce ({shard.numel()} values)")
        self.master.grad = shard.to(torch.float32)

    def apply_gradients(self) -> float:
        """Clip by the global norm (a sum of squares over the cell's slices), AdamW on this
        rank's slice at the scheduled learning rate, the slices gathered back into the
        compute copy. Returns the norm before clipping."""
        g, grad = self.groups, self.master.grad
        sq = torch.tensor([float(torch.linalg.vector_norm(grad)) ** 2], dtype=torch.float64)
        norm = float(all_reduce(g.cell, sq, g.timeout_s, "gradient norm").sqrt())
        if self.max_grad_norm is not None:
            grad.mul_(min(1.0, self.max_grad_norm / (norm + 1e-6)))
        self.last_lr = self._base_lr * self.lr_scale()
        for group in self.optimizer.param_groups:
            group["lr"] = self.last_lr
        try:
            self.optimizer.step()
        finally:
            for group in self.optimizer.param_groups:
                group["lr"] = self._base_lr
        self.step += 1
        self.gather_params()
        return norm

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's slice of the parameters into the compute copy."""
        all_gather(self.groups.cell, self.flat, self.master.detach().clone(), self.groups.timeout_s)
        self.stale_copy = False

    @torch.no_grad()
    def update_ewma(self) -> None:
        """Fold this rank's slice of the parameters into its slice of the EWMA copy; elements
        where the average equals the parameters stay bitwise equal (as the one-rank path keeps
        unmoved vocabulary rows)."""
        avg = self.ewma.inner.params["shard"]
        master = self.master.detach().to(avg.device)  # host memory: a copy where the slice is on a GPU
        same = avg == master
        self.ewma.inner.update({"shard": master})
        torch.where(same, master, avg, out=avg)

    def _optimizer_step(self) -> float:
        """The supervised step's: this step's per-name gradients into the flat buffer, then as
        RL. The per-name gradients are dropped first, so the next step's backward starts from
        zero (not from the sums the flat buffer holds)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.flat)
        flat = self.flat_grad
        for k, v in self._views(flat).items():
            p = self.params[k]
            if p.grad is None:
                v.zero_()
            elif p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
            p.grad = None
        if self.solo_grads and self.groups.cell_rank:
            flat.zero_()
        self.reduce_gradients(None, {})
        norm = self.apply_gradients()
        self.version += 1
        return norm

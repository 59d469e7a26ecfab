"""Sums over the step's data-parallel ranks: one interface, a local one (one rank) and a group one.

Gradients travel as one flat buffer per optimizer step. The vocabulary tables (embedding,
output layer) are reduced on the union of the rows any rank touched, found by a first small
reduction of a row mask: a rank's tokens touch a few hundred of 151,936 rows, and the dense
table would be most of the bytes on the wire. The other rows' gradients are zero on every
rank, so the sum is the same as a dense one.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.distributed import AllreduceOptions, ReduceOp

from cells.transport.p2p import wait_work


class Reducer(Protocol):
    world: int

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """Reduce `t` in place over the ranks (`sum` or `max`); returns it."""
        ...


class LocalReducer:
    """One rank: every reduction is the identity."""

    world = 1

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        return t


class GroupReducer:
    """Reductions over a process group (gloo on CPU cells, NCCL on GPU cells), each op bounded
    by `timeout_s` (a dead or stalled peer fails the step instead of hanging it)."""

    def __init__(self, pg, world: int, timeout_s: float) -> None:
        self.pg, self.world, self.timeout_s = pg, world, timeout_s

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX if op == "max" else ReduceOp.SUM
        wait_work(self.pg.allreduce([t], opts), self.timeout_s, f"all-reduce ({op}, {t.numel()} values)")
        return t


def sum_gradients(reducer: Reducer, params: dict[str, Tensor], touched: dict[str, Tensor],
                  comm_dtype: torch.dtype | None = None) -> None:
    """Sum every parameter's gradient over the ranks in place. `touched[name]` (bool per row)
    marks the rows a vocabulary table's gradient may be non-zero in on this rank; every
    gradient must exist (zeros where a rank has none). `comm_dtype` (bf16): the dtype on the
    wire (the sum is rounded to it once per rank's contribution)."""
    if reducer.world == 1:
        return
    union = {k: reducer.all_reduce(m.to(torch.int32), "max").bool() for k, m in touched.items()}
    parts = []
    for k, p in params.items():
        g = p.grad
        parts.append((g[union[k]] if k in union else g).reshape(-1))
    flat = torch.cat(parts)
    flat = reducer.all_reduce(flat if comm_dtype is None else flat.to(comm_dtype)).to(torch.float32)
    pos = 0
    for k, p in params.items():
        g = p.grad
        n = int(union[k].sum()) * g.shape[1] if k in union else g.numel()
        chunk = flat[pos: pos + n]
        pos += n
        if k in union:
            g[union[k]] = chunk.view(-1, g.shape[1])
        else:
            g.copy_(chunk.view_as(g))

"""The compute weights of a cell's S ranks gathered one layer at a time (the ZeRO-3 / FSDP
layout over the flat slices of cells/rl/shard.py): no rank holds the whole model.

One line: gather layer i from its owners → run it → free it; in the backward: gather it
again → recompute its forward under autograd → reduce its gradient to its owners.

The flat layout (parameters in name order, rank r owning [r·L, (r+1)·L)) keeps each layer
contiguous: the names of `model.layers.<i>.` sort together, so layer i is one range [a, b) of
the flat buffer and lies in the slices of one or a few ranks (its owners; at Qwen3-32B on 8
ranks a layer is 1/64 of the model, a slice 1/8: one or two owners). A gather is a broadcast
of each owner's piece to the cell, a gradient a reduce of each piece to its owner; every
rank sends or receives the layer once either way, as an all-gather / reduce-scatter of it
would. The vocabulary tables and the final norm are gathered the same way (the embedding
for the embedding lookup, the output layer with the final norm for the chunked log-probs).

Every rank of the cell must run the same number of forwards (each one a sequence of
collectives): `lockstep_rounds` gives the cell's most, and a rank with fewer runs
`empty_forward`s. Device-neutral: the gathered buffers live on the slices' device.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp, ReduceOptions

from cells.engine.embedded.model_spec import ModelSpec
from cells.transport.p2p import wait_work

EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


@dataclass
class FlatLayout:
    """Where each name lies in the flat buffer and which rank owns which range."""

    shapes: dict[str, torch.Size]
    size: int
    rank: int
    offsets: dict[str, int] = field(init=False)
    shard_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.offsets, pos = {}, 0
        for k in sorted(self.shapes):
            self.offsets[k] = pos
            pos += self.shapes[k].numel()
        self.num_params = pos
        self.shard_len = -(-pos // self.size)

    def span(self, names: Sequence[str]) -> tuple[int, int]:
        """[a, b) of `names` in the flat buffer; they must be contiguous there."""
        a = min(self.offsets[k] for k in names)
        b = max(self.offsets[k] + self.shapes[k].numel() for k in names)
        if b - a != sum(self.shapes[k].numel() for k in names):
            raise ValueError(f"names not contiguous in the flat layout: {sorted(names)[:3]}")
        return a, b

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(owner rank, lo, hi) for each owner's part of [a, b)."""
        L, out = self.shard_len, []
        for r in range(a // L, (b - 1) // L + 1):
            out.append((r, max(a, r * L), min(b, (r + 1) * L)))
        return out

    def groups(self, spec: ModelSpec) -> dict[str, list[str]]:
        """The gather units: the embedding, each layer, the final norm, the output layer."""
        out = {"embed": [EMBED], "norm": [NORM]}
        if HEAD in self.shapes:
            out["head"] = [HEAD]
        for i in range(spec.num_layers):
            out[f"layer{i}"] = [k for k in self.shapes if k.startswith(f"model.layers.{i}.")]
        return out


class LayerGather:
    """Gathers of a cell's slices, one unit at a time, over the cell's group `pg`.

    `reduce=False` keeps each rank's own gradient (no reduction to the owners): the negative
    control of the tests."""

    def __init__(self, spec: ModelSpec, layout: FlatLayout, pg: Any, timeout_s: float = 120.0,
                 reduce: bool = True, dtype: torch.dtype | None = None) -> None:
        self.spec, self.layout, self.pg, self.timeout_s, self.reduce = spec, layout, pg, timeout_s, reduce
        self.dtype = dtype
        """The compute and wire dtype of the gathered units and their gradients (bf16); None:
        the slices' own (fp32). The slices and their gradient stay fp32 either way."""
        self.units = {k: layout.span(v) for k, v in layout.groups(spec).items()}
        self.names = layout.groups(spec)
        self.live = 0
        """Elements of gathered buffers alive now; `peak_live` the most at once."""
        self.peak_live = 0

    def _track(self, t: Tensor) -> Tensor:
        n = t.numel()
        self.live += n
        self.peak_live = max(self.peak_live, self.live)
        weakref.finalize(t, self._untrack, n)
        return t

    def _untrack(self, n: int) -> None:
        self.live -= n

    @torch.no_grad()
    def gather_range(self, shard: Tensor, a: int, b: int, dtype: torch.dtype | None = None,
                     device: torch.device | None = None) -> Tensor:
        """[a, b) of the flat buffer whose slice on this rank is `shard`, on `shard`'s device:
        a broadcast of each owner's piece, in `dtype` (default: the compute dtype)."""
        lay = self.layout
        out = self._track(torch.empty(b - a, dtype=dtype or self.dtype or shard.dtype, device=device or shard.device))
        for r, lo, hi in lay.pieces(a, b):
            piece = out[lo - a: hi - a]
            if r == lay.rank:
                piece.copy_(shard[lo - r * lay.shard_len: hi - r * lay.shard_len])
            if lay.size > 1:
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor = r, 0
                wait_work(self.pg.broadcast([piece], opts), self.timeout_s, f"layer gather ({hi - lo} values)")
        return out

    @torch.no_grad()
    def reduce_range(self, grad: Tensor, a: int, b: int, shard_grad: Tensor) -> None:
        """Sum `grad` ([a, b) of the flat layout) over the cell into the owners' `shard_grad`."""
        lay = self.layout
        grad = grad.detach().reshape(-1).to(self.dtype or shard_grad.dtype).contiguous()
        for r, lo, hi in lay.pieces(a, b):
            piece = grad[lo - a: hi - a]
            if self.reduce and lay.size > 1:
                opts = ReduceOptions()
                opts.rootRank, opts.reduceOp = r, ReduceOp.SUM
                wait_work(self.pg.reduce([piece], opts), self.timeout_s, f"layer reduce ({hi - lo} values)")
            if r == lay.rank:
                shard_grad[lo - r * lay.shard_len: hi - r * lay.shard_len] += piece.to(shard_grad.dtype)

    def views(self, unit: str, flat: Tensor) -> dict[str, Tensor]:
        a, _ = self.units[unit]
        lay, out = self.layout, {}
        for k in self.names[unit]:
            o = lay.offsets[k] - a
            out[k] = flat[o: o + lay.shapes[k].numel()].view(lay.shapes[k])
        return out

    def unit(self, unit: str, source: Source, anchor: Tensor | None) -> dict[str, Tensor]:
        """The unit's tensors gathered from `source`; with `anchor` (a tensor that requires
        grad) autograd reduces their gradient into `source.grad` in the backward."""
        a, b = self.units[unit]
        if anchor is None:
            return self.views(unit, self.gather_range(source.shard, a, b, device=source.device))
        return self.views(unit, _Gather.apply(anchor, self, source, a, b))

    def gather_full(self, source: Source, device: str | torch.device | None = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Every tensor, gathered unit by unit to `device` (host by default) in `dtype` (default
        the slices': the fp32 master), one unit on the slices' device at a time: publishing."""
        out: dict[str, Tensor] = {}
        for unit, (a, b) in self.units.items():
            flat = self.gather_range(source.shard, a, b, dtype or source.shard.dtype, source.device)
            for k, v in self.views(unit, flat).items():
                if device is not None:  # (None: a rank that takes part and keeps nothing)
                    out[k] = v.to(device, copy=True)
            del flat
        return out

    def lockstep_rounds(self, n: int, device: str | torch.device = "cpu") -> int:
        """The most forwards any rank of the cell runs (each rank passes its own count; `device`
        the group's: cuda on an NCCL group)."""
        t = torch.tensor([float(n)], device=device)
        if self.layout.size > 1:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.MAX
            wait_work(self.pg.allreduce([t], opts), self.timeout_s, "lockstep count")
        return int(t.item())


@dataclass
class Source:
    """This rank's slice of one state (the parameters, the reference, the EWMA copy) and,
    for the parameters, the slice of their gradient that the backward fills."""

    shard: Tensor
    grad: Tensor | None = None
    at: torch.device | None = None
    """Where the gathered units and the forward live (the rank's device; a host-memory slice,
    the reference or the EWMA copy on a GPU cell, is gathered onto it); None: the slice's."""

    @property
    def device(self) -> torch.device:
        return self.shard.device if self.at is None else self.at


class _Gather(torch.autograd.Function):
    """A unit gathered in the forward; its gradient reduced to the owners in the backward.
    The input `anchor` only makes autograd call the backward (it gets no gradient)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, lg: LayerGather, src: Source, a: int, b: int) -> Tensor:
        ctx.lg, ctx.src, ctx.a, ctx.b = lg, src, a, b
        return lg.gather_range(src.shard, a, b, device=src.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        src = ctx.src
        if src.grad is None:
            src.grad = torch.zeros_like(src.shard)
        ctx.lg.reduce_range(grad, ctx.a, ctx.b, src.grad)
        return None, None, None, None, None

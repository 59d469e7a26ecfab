"""The loss's forward over layer-gathered weights (cells/rl/layer_gather.py): several
sequences packed in one forward, each layer gathered just before it runs and freed after; with
autograd each layer (and the final norm with the chunked log-probs) is checkpointed, so the
backward gathers it again, recomputes it and reduces its gradient to its owners.

Per rank, alive at once: the layer being run (two in the backward: the recomputed one and its
gradient), the layer inputs kept by the checkpoints ([T, hidden] per layer), and one chunk of
logits (cells/engine/embedded/logprob_chunks.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from cells.engine.embedded.layers import rms_norm, rope_tables
from cells.engine.embedded.model import Prepared, Segment, _layer, target_logprobs
from cells.rl.layer_gather import EMBED, HEAD, NORM, LayerGather, Source
from cells.rl.objectives.tree import SerializedTree
from cells.rl.trees import _segments


def _layer_tensors(lg: LayerGather, i: int, w: dict[str, Tensor]) -> dict[str, Tensor]:
    """Layer i's tensors in the form `prepare` gives them (fused q/k/v and gate/up)."""
    p = f"model.layers.{i}."
    return {"in_norm": w[p + "input_layernorm.weight"], "post_norm": w[p + "post_attention_layernorm.weight"],
            "qkv": torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "o": w[p + "self_attn.o_proj.weight"], "q_norm": w.get(p + "self_attn.q_norm.weight"),
            "k_norm": w.get(p + "self_attn.k_norm.weight"),
            "gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            "down": w[p + "mlp.down_proj.weight"]}


def _gathered_layer(lg: LayerGather, src: Source, anchor: Tensor | None, i: int, x: Tensor, cos: Tensor,
                    sin: Tensor, segments: list[Segment], tile: int | None) -> Tensor:
    lw = _layer_tensors(lg, i, lg.unit(f"layer{i}", src, anchor))
    return _layer(lg.spec, i, lw, x, cos, sin, segments, tile)


def _head(lg: LayerGather, src: Source, anchor: Tensor | None, rows: Tensor, targets: Tensor,
          temperature: float, tile: int | None, entropy: list | None = None) -> Tensor:
    """Final norm and the chunked target log-probs, the output layer gathered for them."""
    spec = lg.spec
    h = rms_norm(rows, lg.unit("norm", src, anchor)[NORM], spec.rms_norm_eps)
    table = lg.unit("embed", src, anchor)[EMBED] if spec.tie_word_embeddings else lg.unit("head", src, anchor)[HEAD]
    out, id_to_out = spec.output_ids(), None
    if out is not None:
        ids = torch.tensor(out, dtype=torch.long, device=table.device)
        table = table.index_select(0, ids)
        id_to_out = torch.full((spec.vocab_size,), -1, dtype=torch.long, device=table.device)
        id_to_out[ids] = torch.arange(len(out), device=table.device)
    prep = Prepared(spec, {}, [], table, None, rows.new_empty(0), rows.new_empty(0), id_to_out)
    return target_logprobs(prep, h, targets, temperature, tile, entropy)


def _gathered_forward(lg: LayerGather, src: Source, ids: Tensor, positions: Tensor, segments: list[Segment],
                      rows: Tensor, targets: Tensor, *, grad: bool, temperature: float, tile: int | None,
                      rope: tuple[Tensor, Tensor] | None, entropy: list | None) -> Tensor:
    """Log-prob of `targets[j]` after hidden row `rows[j]` of the flat batch `ids`, one layer
    gathered at a time; with `grad` each layer and the head checkpointed."""
    spec, dev = lg.spec, src.device
    if grad and entropy is not None:
        raise ValueError("entropy is a detached forward's (the checkpoints would count it twice)")
    cos_t, sin_t = rope if rope is not None else rope_tables(spec.head_dim, spec.max_position, spec.rope_theta)
    cos, sin = cos_t.to(dev).index_select(0, positions), sin_t.to(dev).index_select(0, positions)
    if lg.dtype is not None:
        cos, sin = cos.to(lg.dtype), sin.to(lg.dtype)
    anchor = torch.zeros((), device=dev, requires_grad=True) if grad else None
    with torch.set_grad_enabled(grad):
        x = lg.unit("embed", src, anchor)[EMBED].index_select(0, ids)
        for i in range(spec.num_layers):
            args = (lg, src, anchor, i, x, cos, sin, segments, tile)
            x = _checkpoint(_gathered_layer, *args, use_reentrant=False) if grad else _gathered_layer(*args)
        args2 = (lg, src, anchor, x.index_select(0, rows), targets, temperature, tile)
        return _checkpoint(_head, *args2, use_reentrant=False) if grad else _head(*args2, entropy)


def packed_logprobs(lg: LayerGather, src: Source, seqs: Sequence[Tensor], *, grad: bool,
                    temperature: float = 1.0, tile: int | None = None,
                    rope: tuple[Tensor, Tensor] | None = None, entropy: list | None = None) -> list[Tensor]:
    """Per-token log-probs of each sequence (index t = token t, 0 at t = 0) from one packed
    forward; with `grad` their backward reduces the gradient into `src.grad` (a collective:
    every rank of the cell calls this the same number of times). With `entropy` (a list, no
    `grad`) each sequence's per-token entropy (same layout) is appended to it."""
    dev = src.device
    if not seqs or any(len(s) < 2 for s in seqs):
        raise ValueError("every sequence needs at least 2 tokens")
    ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs]).to(dev)
    lens = [len(s) for s in seqs]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    segments = [Segment(o, n, 0) for o, n in zip(starts, lens, strict=True)]
    rows = torch.cat([torch.arange(o, o + n - 1) for o, n in zip(starts, lens, strict=True)]).to(dev)
    ent: list | None = [] if entropy is not None else None
    lp = _gathered_forward(lg, src, ids, positions, segments, rows, ids.index_select(0, rows + 1), grad=grad,
                           temperature=temperature, tile=tile, rope=rope, entropy=ent)
    out, pos = [], 0
    for n in lens:
        out.append(torch.cat([lp.new_zeros(1), lp[pos: pos + n - 1]]))
        if entropy is not None:
            entropy.append(torch.cat([lp.new_zeros(1), ent[0][pos: pos + n - 1].to(lp.dtype)]))
        pos += n - 1
    return out


def tree_logprobs(lg: LayerGather, src: Source, ser: SerializedTree, token_ids: Tensor, *, grad: bool,
                  temperature: float = 1.0, tile: int | None = None,
                  rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`tree_token_logprobs` (cells/rl/trees.py) on gathered layers: one forward over the
    serialised tree, each node attending to its own path; 0 for a root's first token."""
    dev = src.device
    ids, prev = token_ids.to(dev), ser.prev_index.to(dev)
    out = _gathered_forward(lg, src, ids, ser.positions.to(dev), _segments(ser), prev.clamp(min=0), ids,
                            grad=grad, temperature=temperature, tile=tile, rope=rope, entropy=None)
    return torch.where(prev >= 0, out, torch.zeros_like(out))


def empty_forward(lg: LayerGather, src: Source, *, grad: bool) -> None:
    """A forward (and backward) that adds nothing: a rank with fewer micro-batches than the
    cell's most runs these, so every rank takes part in every layer's gather and reduce."""
    out = lg.spec.output_ids()
    t = out[0] if out else 0
    (lp,) = packed_logprobs(lg, src, [torch.tensor([t, t])], grad=grad)
    if grad:
        (lp.sum() * 0.0).backward()

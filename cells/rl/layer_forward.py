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
          temperature: float, tile: int | None) -> Tensor:
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
    return target_logprobs(prep, h, targets, temperature, tile)


def packed_logprobs(lg: LayerGather, src: Source, seqs: Sequence[Tensor], *, grad: bool,
                    temperature: float = 1.0, tile: int | None = None,
                    rope: tuple[Tensor, Tensor] | None = None) -> list[Tensor]:
    """Per-token log-probs of each sequence (index t = token t, 0 at t = 0) from one packed
    forward; with `grad` their backward reduces the gradient into `src.grad` (a collective:
    every rank of the cell calls this the same number of times)."""
    spec, dev = lg.spec, src.shard.device
    if any(len(s) < 2 for s in seqs) or not seqs:
        raise ValueError("every sequence needs at least 2 tokens")
    ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs]).to(dev)
    lens = [len(s) for s in seqs]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    segments = [Segment(o, n, 0) for o, n in zip(starts, lens, strict=True)]
    cos_t, sin_t = rope if rope is not None else rope_tables(spec.head_dim, spec.max_position, spec.rope_theta)
    cos, sin = cos_t.to(dev).index_select(0, positions), sin_t.to(dev).index_select(0, positions)
    if lg.dtype is not None:
        cos, sin = cos.to(lg.dtype), sin.to(lg.dtype)
    rows = torch.cat([torch.arange(o, o + n - 1) for o, n in zip(starts, lens, strict=True)]).to(dev)
    anchor = torch.zeros((), device=dev, requires_grad=True) if grad else None
    with torch.set_grad_enabled(grad):
        x = lg.unit("embed", src, anchor)[EMBED].index_select(0, ids)
        for i in range(spec.num_layers):
            args = (lg, src, anchor, i, x, cos, sin, segments, tile)
            x = _checkpoint(_gathered_layer, *args, use_reentrant=False) if grad else _gathered_layer(*args)
        hidden = x.index_select(0, rows)
        args2 = (lg, src, anchor, hidden, ids.index_select(0, rows + 1), temperature, tile)
        lp = _checkpoint(_head, *args2, use_reentrant=False) if grad else _head(*args2)
    out, pos = [], 0
    for n in lens:
        out.append(torch.cat([lp.new_zeros(1), lp[pos: pos + n - 1]]))
        pos += n - 1
    return out


def empty_forward(lg: LayerGather, src: Source, *, grad: bool) -> None:
    """A forward (and backward) that adds nothing: a rank with fewer micro-batches than the
    cell's most runs these, so every rank takes part in every layer's gather and reduce."""
    out = lg.spec.output_ids()
    t = out[0] if out else 0
    (lp,) = packed_logprobs(lg, src, [torch.tensor([t, t])], grad=grad)
    if grad:
        (lp.sum() * 0.0).backward()

"""Qwen3-architecture decoder as pure functions over a weight dict with Hugging Face names.

RMSNorm, RoPE, GQA, SwiGLU, q/k-norm. The same `forward` serves the engine (segments of new
tokens whose K/V go to the paged cache) and scoring/training (one segment, no cache, autograd
intact), so the log-prob service and the trainer run the sampler's own numerics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from cells.engine.embedded.layers import (
    apply_rope,
    attention_fast,
    attention_tiled,
    linear,
    rms_norm,
    rope_tables,
)
from cells.engine.embedded.logprob_chunks import chunked_target_logprobs, head_logprobs
from cells.engine.embedded.model_spec import ModelSpec
from cells.engine.records import EngineError


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model by its Hugging Face name."""
    d, hd = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, d), "model.norm.weight": (d,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.num_heads * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (spec.num_kv_heads * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (spec.num_kv_heads * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, spec.num_heads * hd)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, spec.intermediate_size)
    return shapes


def init_weights(spec: ModelSpec, seed: int = 0, std: float = 0.02, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights made tensor by tensor on `device` in `dtype` (no float32 copy of the
    whole model anywhere). On CPU drawn in float32 and cast; on a GPU drawn there with a
    generator of that device (same seed, same weights on every GPU; not the CPU's)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(spec).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=dev, dtype=dtype)
        elif dev.type == "cpu":
            out[name] = (torch.randn(shape, generator=g) * std).to(dtype)
        else:
            out[name] = torch.randn(shape, generator=g, device=dev, dtype=dtype).mul_(std)
    return out


def check_weights(spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Raise EngineError naming the first missing, unexpected or mis-shaped tensor."""
    shapes = weight_shapes(spec)
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise EngineError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise EngineError(f"weight {name} has shape {tuple(tensors[name].shape)}, model needs {shape}")


@dataclass
class Prepared:
    """Per-version derived tensors: fused projections and the restricted output layer."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    layers: list[dict[str, torch.Tensor]]
    lm_head: torch.Tensor
    out_ids: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    id_to_out: torch.Tensor | None = field(default=None)
    checkpoint: bool | str = False
    """Activation checkpointing in a forward with autograd (`forward`): True per half layer
    (attention, MLP), "layer" per layer."""


def prepare(spec: ModelSpec, weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor] | None = None,
            checkpoint: bool | str = False, dtype: torch.dtype | None = None) -> Prepared:
    """Per-version tensors; with `dtype` (bf16 compute) a cast of every weight (autograd
    flows back through it to the fp32 weights) and of the rotary tables."""
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layers.append({
            "in_norm": weights[p + "input_layernorm.weight"],
            "post_norm": weights[p + "post_attention_layernorm.weight"],
            "qkv": torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "o": weights[p + "self_attn.o_proj.weight"],
            "q_norm": weights.get(p + "self_attn.q_norm.weight"),
            "k_norm": weights.get(p + "self_attn.k_norm.weight"),
            "gate_up": torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]),
            "down": weights[p + "mlp.down_proj.weight"],
        })
    head = weights["model.embed_tokens.weight"] if spec.tie_word_embeddings else weights["lm_head.weight"]
    out_ids = spec.output_ids()
    id_to_out = None
    if out_ids is not None:
        dev = head.device
        ids = torch.tensor(out_ids, dtype=torch.long, device=dev)
        head = head.index_select(0, ids)
        id_to_out = torch.full((spec.vocab_size,), -1, dtype=torch.long, device=dev)
        id_to_out[ids] = torch.arange(len(out_ids), device=dev)
        out_ids_t = ids
    else:
        out_ids_t = None
    cos, sin = rope if rope is not None else rope_tables(spec.head_dim, spec.max_position, spec.rope_theta)
    if dtype is not None:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return Prepared(spec, weights, layers, head.contiguous(), out_ids_t, cos, sin, id_to_out, checkpoint)


class KVSink(Protocol):
    """Where a segment's keys/values live: the paged cache, or nowhere (scoring)."""

    def store_and_load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this segment's new k/v and return all keys/values [0, start+n)."""
        ...


@dataclass(slots=True)
class Segment:
    """A run of consecutive new tokens of one sequence inside a flat token batch."""

    offset: int
    length: int
    start_pos: int
    kv: KVSink | None = None


def forward(prep: Prepared, token_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
            tile: int | None) -> torch.Tensor:
    """Hidden states after the final norm, [N, hidden] for the flat batch `token_ids`.

    With `prep.checkpoint` and autograd on, each half of a layer (attention, MLP), or each layer
    ("layer"), keeps only its input for the backward and recomputes its activations there."""
    x = prep.weights["model.embed_tokens.weight"].index_select(0, token_ids)
    cos, sin = prep.cos.index_select(0, positions), prep.sin.index_select(0, positions)
    recompute = torch.is_grad_enabled() and all(s.kv is None for s in segments) and prep.checkpoint
    for li, lw in enumerate(prep.layers):
        if recompute == "layer":  # the layer's input kept; its activations live again in the backward
            x = _checkpoint(_layer, prep.spec, li, lw, x, cos, sin, segments, tile, use_reentrant=False)
        elif recompute:  # each half of the layer on its own: the backward holds one half's activations
            x = _checkpoint(_attention_block, prep.spec, li, lw, x, cos, sin, segments, tile, use_reentrant=False)
            x = _checkpoint(_mlp_block, prep.spec, lw, x, tile, use_reentrant=False)
        else:
            x = _layer(prep.spec, li, lw, x, cos, sin, segments, tile)
    return rms_norm(x, prep.weights["model.norm.weight"], prep.spec.rms_norm_eps)


def _layer(spec: ModelSpec, li: int, lw: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, segments: list[Segment], tile: int | None) -> torch.Tensor:
    return _mlp_block(spec, lw, _attention_block(spec, li, lw, x, cos, sin, segments, tile), tile)


def _attention_block(spec: ModelSpec, li: int, lw: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, segments: list[Segment], tile: int | None) -> torch.Tensor:
    hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    h = rms_norm(x, lw["in_norm"], spec.rms_norm_eps)
    qkv = linear(h, lw["qkv"], tile)
    q = qkv[:, : nh * hd].reshape(-1, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].reshape(-1, nkv, hd)
    if lw["q_norm"] is not None:
        q = rms_norm(q, lw["q_norm"], spec.rms_norm_eps)
        k = rms_norm(k, lw["k_norm"], spec.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    outs = []
    for seg in segments:
        sl = slice(seg.offset, seg.offset + seg.length)
        ks, vs = (k[sl], v[sl]) if seg.kv is None else seg.kv.store_and_load(li, k[sl], v[sl])
        if tile is None:
            outs.append(attention_fast(q[sl], ks, vs, seg.start_pos))
        else:
            outs.append(attention_tiled(q[sl], ks, vs, seg.start_pos, tile))
    attn = (torch.cat(outs) if len(outs) > 1 else outs[0]).reshape(-1, nh * hd)
    return x + linear(attn, lw["o"], tile)


def _mlp_block(spec: ModelSpec, lw: dict[str, torch.Tensor], x: torch.Tensor, tile: int | None) -> torch.Tensor:
    h = rms_norm(x, lw["post_norm"], spec.rms_norm_eps)
    gu = linear(h, lw["gate_up"], tile)
    gate, up = gu.split(spec.intermediate_size, dim=-1)
    return x + linear(torch.nn.functional.silu(gate) * up, lw["down"], tile)


def output_logprobs(prep: Prepared, hidden: torch.Tensor, temperature: float | torch.Tensor,
                    tile: int | None) -> torch.Tensor:
    """Temperature-scaled log-probs over the output ids, [N, V_out].

    `temperature` is one float or one per row; 0 (greedy) scores at temperature 1.
    """
    return head_logprobs(prep.lm_head, hidden, temperature, tile)


def target_logprobs(prep: Prepared, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    tile: int | None, entropy: list | None = None) -> torch.Tensor:
    """Log-prob of `targets[i]` (vocabulary ids) at row i of `hidden`, -inf outside the output
    ids, without the [N, V_out] log-probs: chunks of rows (cells/engine/embedded/logprob_chunks.py,
    recomputed in the backward). With `entropy` (a list), each row's entropy is appended."""
    if prep.id_to_out is None:
        idx = targets
    else:
        idx = prep.id_to_out.index_select(0, targets)
    out = chunked_target_logprobs(prep.lm_head, hidden, idx.clamp(min=0), temperature, tile, entropy)
    return out if prep.id_to_out is None else torch.where(idx >= 0, out, torch.full_like(out, float("-inf")))


def token_logprobs(prep: Prepared, token_ids: torch.Tensor, temperature: float = 1.0,
                   tile: int | None = None, entropy: list | None = None) -> torch.Tensor:
    """Cache-free full forward: log-prob of token t given tokens < t for t = 1..L-1.

    The scoring primitive of the log-prob service and the trainer's forward (autograd
    flows through `prep.weights`). Tokens outside the output ids get -inf. With `entropy`
    (a list), the policy's entropy at each of those positions is appended to it (detached).
    """
    n = token_ids.shape[0]
    if n < 2:
        return torch.empty(0, device=token_ids.device)
    positions = torch.arange(n, device=token_ids.device)
    hidden = forward(prep, token_ids, positions, [Segment(0, n, 0)], tile)
    ent: list | None = [] if entropy is not None else None
    out = target_logprobs(prep, hidden[:-1], token_ids[1:], temperature, tile, ent)
    if entropy is not None:
        entropy.append(ent[0])
    return out

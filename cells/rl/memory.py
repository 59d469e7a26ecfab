"""Per-rank training memory as a formula (docs/TRAINING.md evaluates it; bench/train.py checks it
against a rank process's measured peak).

Two layouts:

- `built`: what cells/rl/shard.py runs. Every rank keeps the whole fp32 compute copy of the
  parameters (4 B/param) and 1/S of the rest: AdamW's moments 8, the reference 4, the EWMA
  copy 4, the guard's snapshot 16 (master 4, moments 8, EWMA 4): 4 + 32/S bytes a parameter
  at rest. During an update, the larger of two phases: the start, with the reference and the
  EWMA copy gathered whole (8) for the detached forwards; a minibatch, with the whole flat
  gradient (4), its reduced slice (4/S), the slice sent to the all-gather (4/S), the EWMA's
  equality mask (1/S byte) and the micro-batch's activations. gloo stages an all-gather's
  whole output once more (4; NCCL writes in place).
- `layer_gathered`: the compute copy sharded too (cells/rl/layer_gather.py; `GatheredLearner`
  in cells/rl/shard_gathered.py, what a cell's ranks build under `trainer.shard_layout:
  gathered`). On the rank's device: the fp32 master slice 4/S, AdamW's moments 8/S, the
  gradient slice e/S in the compute dtype (4 fp32, 2 under `precision: bf16`): (12 + e)/S;
  the reference, EWMA copy and the guard's snapshot slices (24/S) where `host_offload` puts
  them (pinned host memory on a GPU cell). Gathered at once, in the compute dtype (e bytes): a
  unit (a layer, or a vocabulary table), its gradient, and for a layer the fused q/k/v and
  gate/up copies `_layer_tensors` makes and their gradients: e·2·(U + F), the largest unit's.
  Activations with a checkpoint per layer (each layer's input kept, one layer's A live again
  in the backward), and two log-prob chunks.
  The optimizer step casts the gradient a chunk at a time (64 MiB of fp32, twice with the
  clip's scaling) after the backward, when no unit or activation is live: below the peak.
- `sharded_compute`: the paper estimate made before `layer_gathered` was built (bf16 gradient
  slice, a layer's units counted as 2·2 + 4 bytes a parameter); kept for the record.

Activations: a layer's backward keeps about A = 7d + 4i + 4(h + h_kv)·d_h + 22 values per token
(d hidden, i MLP width, h / h_kv query / key-value heads of d_h; the constant: the norms' and
attention's per-row statistics), counted from the saved tensors of cells/engine/embedded/
model.py. With checkpointing each layer (d) or half-layer (2d per layer) keeps its input and
one layer's A is live again in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from cells.engine.embedded.model_spec import ModelSpec

QWEN3_32B = ModelSpec(hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                      intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False, max_position=40960)
"""Qwen3-32B's shapes (32.8 B parameters)."""

STATE_BYTES_PER_PARAM = {"params": 4, "grads": 4, "moments": 8, "reference": 4, "ewma": 4, "snapshot": 16}
"""One fp32 rank's state (B = 40): what a rank holds whole without sharding."""


def num_params(spec: ModelSpec) -> int:
    from cells.engine.embedded.model import weight_shapes

    total = 0
    for shape in weight_shapes(spec).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def activation_values_per_token(spec: ModelSpec) -> int:
    """A: values a layer keeps per token for its backward (see the module's text)."""
    return (7 * spec.hidden_size + 4 * spec.intermediate_size
            + 4 * (spec.num_heads + spec.num_kv_heads) * spec.head_dim + 22)


def layer_params(spec: ModelSpec) -> int:
    d, i, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    return d * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 3 * d * i + 2 * d + 2 * hd


@dataclass(frozen=True)
class Config:
    spec: ModelSpec
    ranks: int
    """S: ranks per cell."""
    tokens: int
    """Tokens in one backward's graph (a micro-batch's sequences, or one tree)."""
    backend: str = "gloo"
    checkpoint: bool | str = False
    """True: per half layer (2d values a token per layer kept); "layer": per layer (d)."""
    act_bytes: int = 4
    """Bytes per activation value (4 fp32, 2 bf16)."""
    logit_chunk_bytes: int = 8 << 20


def activations(c: Config) -> int:
    a, layers = activation_values_per_token(c.spec), c.spec.num_layers
    if c.checkpoint:
        kept = (1 if c.checkpoint == "layer" else 2) * c.spec.hidden_size * layers
        return c.tokens * c.act_bytes * (kept + a)
    return c.tokens * c.act_bytes * a * layers


def built(c: Config) -> dict[str, float]:
    """Per-rank bytes of cells/rl/shard.py's layout, by term; `peak` is their maximum phase."""
    p, s = num_params(c.spec), c.ranks
    rest = p * (4 + 32 / s)
    staging = 4 * p if c.backend == "gloo" else 0
    start = 8 * p
    step = p * (4 + 8.5 / s) + activations(c) + 2 * c.logit_chunk_bytes
    return {"params": p, "rest": rest, "start": start, "step": step, "staging": staging,
            "peak": rest + max(start, step) + staging}


def sharded_compute(c: Config, host_offload: bool = True) -> dict[str, float]:
    """Per-GPU bytes of the paper estimate (see the module's text; `layer_gathered` is built)."""
    p, s, lp = num_params(c.spec), c.ranks, layer_params(c.spec)
    state = p * (4 + 8 + 2) / s + (0 if host_offload else p * (4 + 4 + 16) / s)
    layers = 2 * 2 * lp + 4 * lp
    peak = state + layers + activations(c) + 2 * c.logit_chunk_bytes
    return {"params": p, "state": state, "layers": layers, "activations": activations(c), "peak": peak,
            "host": p * (4 + 4 + 16) / s if host_offload else 0}


def fused_params(spec: ModelSpec) -> int:
    """F: the fused copies a gathered layer makes (q/k/v and gate/up concatenated)."""
    d, hd = spec.hidden_size, spec.head_dim
    return d * hd * (spec.num_heads + 2 * spec.num_kv_heads) + 2 * d * spec.intermediate_size


def layer_gathered(c: Config, host_offload: bool = True) -> dict[str, float]:
    """Per-rank bytes of the layer-gathered layout (cells/rl/layer_gather.py), by term; `device`
    what the rank's device holds at its peak, `host` the slices kept in host memory."""
    p, s, e = num_params(c.spec), c.ranks, c.act_bytes
    table = c.spec.vocab_size * c.spec.hidden_size
    slices = (12 + e) * p / s
    kept = 24 * p / s
    gathered = e * 2 * max(layer_params(c.spec) + fused_params(c.spec), table)
    act = activations(Config(c.spec, s, c.tokens, c.backend, "layer", e, c.logit_chunk_bytes))
    device = slices + (0 if host_offload else kept) + gathered + act + 2 * c.logit_chunk_bytes
    return {"params": p, "slices": slices, "gathered": gathered, "activations": act,
            "chunks": 2 * c.logit_chunk_bytes, "device": device, "host": kept if host_offload else 0}

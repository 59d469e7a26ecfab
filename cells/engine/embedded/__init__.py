"""The embedded torch engine (CPU by default): continuous batching over a paged KV cache,
per-request KV hand-over, cache-free scoring with the sampler's numerics, staged weight
versions. `engine.py` is the engine; the rest are its parts (batcher, KV pool, model,
sampler, checkpoint loading, hand-over; log-probs in chunks without the [T, V] logits)."""

from cells.engine.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]

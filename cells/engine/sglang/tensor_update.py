"""A version installed from tensors in the cell process (catch-up, a version deferred while the
weights' memory was with training), for SGLang cells.

One line: begin → per bucket of ≤ `TENSOR_BUCKET_BYTES`: flatten on the cell's GPU → one
`update_weights_from_tensor(load_format="flattened_bucket")`, the cache flushed only after
the last → end.

Why not the whole version in one call: SGLang serialises a `named_tensors` list once per TP
rank and each rank moves every tensor it gets (unsharded) to its GPU before loading, so a
whole version costs every GPU the full model once more (Qwen3-32B at tp 8: ~64 GB each);
and CPU tensors travel through shared memory (/dev/shm the size of the payload). A
flattened bucket on the cell's GPU travels as one CUDA IPC handle per rank: the cell's GPU
holds one bucket, the ranks load from it, /dev/shm holds nothing.

Each rank gets its own payload (SGLang's rule: a rank decodes only its own, so the IPC
reference counts drop after every load). Payloads are SGLang's own encoding
(`SGLangModules.serialize`), made and read on this node; cellflip never decodes one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    flatten_bucket,
    plan_buckets,
    torch_dtype,
)

TENSOR_BUCKET_BYTES = 512 << 20
"""Bytes per `update_weights_from_tensor` call (a larger tensor travels alone)."""


def update_device(server_args: Mapping[str, Any]) -> torch.device:
    """Where payloads are staged: the cell's first GPU (SGLang's `base_gpu_id`), or the CPU
    on a machine without one (tests against the fake)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(server_args.get("base_gpu_id") or 0))
    return torch.device("cpu")


def flattened_metadata(spec: BucketSpec, tensor_bucket: Any) -> list:
    """SGLang's `FlattenedTensorMetadata` for `spec`'s tensors laid out by `flatten_bucket`
    (offsets and sizes in bytes)."""
    out, offset = [], 0
    for m in spec.metas():
        out.append(tensor_bucket.FlattenedTensorMetadata(
            name=m.name, shape=torch.Size(m.shape), dtype=torch_dtype(m.dtype),
            start_idx=offset, end_idx=offset + m.nbytes, numel=m.nbytes))
        offset += m.nbytes
    return out


def send_in_buckets(tensors: Mapping[str, torch.Tensor], send: Callable[[list, bool], None], *,
                    modules: Any, tp: int, device: torch.device,
                    bucket_bytes: int = TENSOR_BUCKET_BYTES) -> int:
    """Call `send(payloads, is_last)` once per bucket of `tensors`, in order, with one payload
    per TP rank. A bucket's buffer on `device` lives until its `send` returns (SGLang has
    loaded it by then), so `device` holds one bucket at a time. Returns the bucket count."""
    specs = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    for i, spec in enumerate(specs):
        flat = flatten_bucket([tensors[n] for n in spec.names]).to(device)
        payload = {"flattened_tensor": flat, "metadata": flattened_metadata(spec, modules.tensor_bucket)}
        send([modules.serialize(payload) for _ in range(tp)], i == len(specs) - 1)
        del payload, flat
    return len(specs)

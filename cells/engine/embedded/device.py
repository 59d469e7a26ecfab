"""Where the embedded engine's tensors live and in which dtype.

`engine.device` names a device (`cpu`, `cuda`: the cell's local GPU, `cuda:N`) and
`engine.dtype` the weights' and KV cache's dtype. Every tensor the engine makes is made there
(weights, KV pool, RoPE tables, index tensors, sampling); log-softmax and sampling run in
float32 whatever the dtype. Host staging (`to_host`) is the path every transfer takes that
must work everywhere: gloo moves host tensors only, so a GPU tensor goes through a pinned
host copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from cells.engine.records import EngineError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_DEFAULT_BLOCKS = 2048
"""KV blocks of a CPU pool when `num_blocks` is unset (the CPU default before it was optional)."""


def resolve_device(name: str | torch.device) -> torch.device:
    """`cpu`, `cuda` (the cell's local GPU: `LOCAL_RANK`, else the current device) or `cuda:N`;
    a clear error when the device is not there."""
    dev = torch.device(name)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise EngineError(f"engine.device {str(name)!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise EngineError(f"engine.device {str(name)!r}: CUDA is not available in this process")
    count = torch.cuda.device_count()
    if dev.index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) % count if local is not None else torch.cuda.current_device()
        dev = torch.device("cuda", index)
    if dev.index >= count:
        raise EngineError(f"engine.device {str(name)!r}: this process sees {count} GPU(s)")
    return dev


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise EngineError(f"engine.dtype {name}: supported are {sorted(DTYPES)}")
        return name
    if name not in DTYPES:
        raise EngineError(f"engine.dtype {name!r}: supported are {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pool_blocks(num_blocks: int | None, device: torch.device, bytes_per_block: int, fraction: float) -> int:
    """The KV pool's size: as configured, else 2048 on CPU, else `fraction` of the GPU's free
    memory (measured now: call it after the weights are on the device)."""
    if num_blocks is not None:
        return num_blocks
    if device.type == "cpu":
        return CPU_DEFAULT_BLOCKS
    free, _total = torch.cuda.mem_get_info(device)
    n = int(free * fraction) // bytes_per_block
    if n < 1:
        raise EngineError(f"{device}: {free / 2**30:.2f} GiB free holds no KV block of {bytes_per_block} bytes")
    return n


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy (pinned when it comes from a GPU, so the copy runs at the link's rate and a
    gloo send reads it directly); a host tensor is returned as it is."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def engine_tensors(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an embedded engine's state, by a readable name (device checks)."""
    yield "kv.k", engine.pool.k
    yield "kv.v", engine.pool.v
    yield "rope.cos", engine._rope[0]
    yield "rope.sin", engine._rope[1]
    for v, prep in engine._versions.items():
        for name, t in prep.weights.items():
            yield f"v{v}.{name}", t
        for i, layer in enumerate(prep.layers):
            for name, t in layer.items():
                if t is not None:
                    yield f"v{v}.layer{i}.{name}", t
        yield f"v{v}.lm_head", prep.lm_head
        for name in ("out_ids", "id_to_out", "cos", "sin"):
            t = getattr(prep, name)
            if t is not None:
                yield f"v{v}.{name}", t


def misplaced(engine, device: torch.device) -> list[str]:
    """Names of the engine's tensors that are not on `device` (empty: all are)."""
    return [f"{name}@{t.device}" for name, t in engine_tensors(engine) if t.device != device]

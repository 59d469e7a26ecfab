"""Weight-version transfer to SGLang cells: bucket plans, the flattened wire format, groups.

SGLang's receiver contract (`Engine.update_weights_from_distributed` with
`load_format="flattened_bucket"`): for every call the receiver allocates one uint8 buffer
laid out as the listed tensors back to back (names, dtypes as `torch` attribute names such
as "bfloat16", shapes), each tensor starting at a byte offset that is a multiple of its
item size, and joins one `broadcast(src=0)` over the update group into it. The sender
(the trainer, rank 0) flattens the same tensors in the same order with `flatten_bucket`.
A bucket's CRC32 covers exactly those bytes; SGLang itself does not check it, so the
cell's scoring copy (an extra rank in `cell_copy` mode) verifies it.

The update group is the "stateless process group" of RL frameworks: a TCP rendezvous at
the sender, a store prefixed by the group name, and one backend object per group, outside
torch's global group registry. `join_update_group` builds the same store layout as SGLang's
`init_custom_process_group`, so a cell-side rank can sit in a group with SGLang's ranks.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from cells.engine.records import EngineError

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn",
    "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype string SGLang resolves with `getattr(torch, name)`."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise EngineError(f"dtype {dtype} cannot travel to SGLang; supported: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise EngineError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name (Hugging Face checkpoint name), dtype name and shape of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch_dtype(self.dtype).itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(t.dtype), tuple(t.shape))


@dataclass(frozen=True)
class BucketSpec:
    """One `update_weights_from_distributed` call: what the receiver allocates, in order."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    crc32: int | None = None
    """CRC32 of the flattened bytes (set by the sender); checked by the scoring copy."""

    def __post_init__(self) -> None:
        if not self.names or not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise EngineError("a bucket needs equally many names, dtypes and shapes (at least one)")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
                raise EngineError(f"bad shape for {name}: {shape!r}")
        offset = 0
        for meta in self.metas():
            if offset % torch_dtype(meta.dtype).itemsize:
                raise EngineError(f"{meta.name} would start at byte {offset}, not aligned to {meta.dtype}")
            offset += meta.nbytes

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtypes, self.shapes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas())

    def to_dict(self) -> dict:
        return {"names": list(self.names), "dtypes": list(self.dtypes),
                "shapes": [list(s) for s in self.shapes], "crc32": self.crc32}

    @classmethod
    def from_dict(cls, d: dict) -> BucketSpec:
        try:
            return cls(tuple(d["names"]), tuple(d["dtypes"]),
                       tuple(tuple(int(x) for x in s) for s in d["shapes"]), d.get("crc32"))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"malformed bucket spec: {e}") from None


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketSpec]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor
    travels alone). A tensor whose offset would break its dtype's alignment opens a new
    bucket, because SGLang's receiver refuses unaligned offsets."""
    if bucket_bytes <= 0:
        raise EngineError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    size = 0
    for m in metas:
        aligned = size % torch_dtype(m.dtype).itemsize == 0
        if not buckets or size + m.nbytes > bucket_bytes or not aligned:
            buckets.append([])
            size = 0
        buckets[-1].append(m)
        size += m.nbytes
    return [BucketSpec(tuple(m.name for m in b), tuple(m.dtype for m in b),
                       tuple(m.shape for m in b)) for b in buckets]


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of `tensors`, back to back, as one uint8 tensor (SGLang's flattened layout)."""
    return torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, spec: BucketSpec) -> dict[str, torch.Tensor]:
    """Views into `flat`, one per tensor of `spec`."""
    if flat.dtype != torch.uint8 or flat.numel() != spec.nbytes:
        raise EngineError(f"bucket holds {flat.numel()} {flat.dtype} elements, spec says {spec.nbytes} bytes")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for m in spec.metas():
        out[m.name] = flat[offset:offset + m.nbytes].view(torch_dtype(m.dtype)).reshape(m.shape)
        offset += m.nbytes
    return out


def bucket_crc32(flat: torch.Tensor) -> int:
    return zlib.crc32(flat.detach().cpu().numpy().tobytes()) & 0xFFFFFFFF


def read_checkpoint_manifest(model_path: str | Path) -> dict[str, TensorMeta] | None:
    """Names, dtypes and shapes of a checkpoint's tensors, from its safetensors headers
    (no tensor data is read). None when the directory holds no safetensors file."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    manifest: dict[str, TensorMeta] = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
            manifest[name] = TensorMeta(name, dtype, tuple(info["shape"]))
    return manifest


def check_against_manifest(metas: Sequence[TensorMeta], manifest: dict[str, TensorMeta] | None,
                           *, require_all: bool) -> None:
    """Raise EngineError on an unknown name, a shape mismatch, a duplicate, or (with
    `require_all`) a manifest tensor left out. Dtypes may differ: SGLang casts on load."""
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise EngineError(f"tensor {m.name} sent twice in one version")
        seen.add(m.name)
        torch_dtype(m.dtype)
        if manifest is None:
            continue
        want = manifest.get(m.name)
        if want is None:
            raise EngineError(f"unknown tensor {m.name} (not in the checkpoint's manifest)")
        if tuple(want.shape) != tuple(m.shape):
            raise EngineError(f"shape mismatch for {m.name}: got {tuple(m.shape)}, model has {want.shape}")
    if require_all and manifest is not None:
        missing = sorted(set(manifest) - seen)
        if missing:
            raise EngineError(f"a full version is needed (weights were released); missing {missing[:5]}"
                              f"{' …' if len(missing) > 5 else ''}")


@dataclass(frozen=True)
class UpdateGroup:
    """Where the sender of one version listens. Ranks: sender 0, then each cell's block of
    `num_update_ranks` starting at its `rank_offset` (SGLang's tp ranks, then the scoring copy)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"
    barrier_s: float | None = None
    """How long the sender waits for every member at the join barrier (barrier.py)
    before it aborts the attempt; None: the sender holds no barrier."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in
                ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "barrier_s")}


def join_update_group(group: UpdateGroup, rank: int, timeout_s: float, *, store=None):
    """Join `group` as `rank` and return the backend object (broadcast with `broadcast_bucket`).

    Store layout as in SGLang's `init_custom_process_group` over torch's group helper:
    TCPStore at the sender → prefix `group_name` → prefix `group_name/` → prefix `cpu/`
    (gloo) or `cuda/` (nccl). Rank 0 hosts the store; a sender that already serves the
    rendezvous store at `master_address:master_port` passes it as `store`."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(group.master_address, group.master_port, group.world_size,
                                           is_master=(rank == 0), timeout=timeout, multi_tenant=True)
    store = torch.distributed.PrefixStore(group.group_name, store)
    store = torch.distributed.PrefixStore(f"{group.group_name}/", store)
    if group.backend == "gloo":
        return torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore("cpu/", store), rank, group.world_size, timeout)
    if group.backend == "nccl":
        from cells.transport.p2p import _nccl_error_mode

        _nccl_error_mode()  # a peer's failure raises here instead of tearing the process down
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(
            torch.distributed.PrefixStore("cuda/", store), rank, group.world_size, opts)
    raise ValueError(f"unsupported update-group backend {group.backend!r}; supported: gloo, nccl")


def broadcast_bucket(pg, flat: torch.Tensor, timeout_s: float) -> None:
    """One broadcast from rank 0 into `flat` (in place on receivers), bounded by a timeout:
    a peer that aborted leaves the collective hanging otherwise."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    work = pg.broadcast([flat], opts)
    if not work.wait(timedelta(seconds=timeout_s)):
        raise EngineError("weight bucket broadcast timed out")

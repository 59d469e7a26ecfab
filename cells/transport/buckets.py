"""A weight version as CRC-checked byte buckets: the layout that the broadcast and the
point-to-point catch-up share.

A version's tensors lie end to end in one flat byte space (manifest order), cut into buckets
of `bucket_bytes`; a tensor may span buckets, so every op moves the same amount however big
or small the tensors are. On the wire a bucket is its payload followed by a 16-byte footer:
CRC32 of the payload, bucket index, version (little-endian u32, u32, u64). The footer rides
in the same tensor as the payload, so the checksum costs no extra op and the sender computes
it while the previous bucket is in flight, instead of a whole pass over the weights up front.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from functools import cached_property

import torch

try:  # zlib's CRC-32, bit for bit, several times faster (carry-less multiply): on a cell every
    from isal.isal_zlib import crc32  # cycle of the check is taken from decoding
except ImportError:  # pragma: no cover - the same checksum, slower
    from zlib import crc32

from cells.transport.p2p import TransferError

FOOTER = struct.Struct("<IIQ")

DEFAULT_BUCKET_BYTES = 64 << 20
"""Big enough that per-op latency vanishes, small enough that two in flight stay cheap."""

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


class ChecksumError(TransferError):
    """A bucket arrived with bytes that do not match its CRC32; the version is not usable."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset of this tensor in the version's flat byte space."""
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """Names, dtypes, shapes and the bucket cut of one version; travels as JSON."""

    version: int
    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]

    @classmethod
    def build(cls, version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Manifest:
        entries = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
        return cls._layout(version, bucket_bytes, entries)

    @classmethod
    def _layout(cls, version: int, bucket_bytes: int, entries) -> Manifest:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        specs, offset = [], 0
        for name, dtype, shape in entries:
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: unsupported dtype {dtype!r}; supported: {sorted(_DTYPES)}")
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * _DTYPES[dtype].itemsize
            specs.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), offset, nbytes))
            offset += nbytes
        return cls(int(version), int(bucket_bytes), tuple(specs))

    @property
    def total_bytes(self) -> int:
        return self.tensors[-1].offset + self.tensors[-1].nbytes if self.tensors else 0

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes)

    def bucket_range(self, index: int) -> tuple[int, int]:
        start = index * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def wire_bytes(self, index: int) -> int:
        """Size of bucket `index` on the wire: payload plus footer."""
        start, end = self.bucket_range(index)
        return end - start + FOOTER.size

    def pieces(self, index: int):
        """(spec, byte range in the tensor, byte range in the bucket) for each overlapping tensor."""
        start, end = self.bucket_range(index)
        for i in range(bisect.bisect_right(self._ends, start), len(self.tensors)):
            s = self.tensors[i]
            if s.offset >= end:
                break
            a, b = max(start, s.offset), min(end, s.offset + s.nbytes)
            if a < b:
                yield s, (a - s.offset, b - s.offset), (a - start, b - start)

    @cached_property
    def _ends(self) -> list[int]:
        return [s.offset + s.nbytes for s in self.tensors]

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, s.dtype, list(s.shape)] for s in self.tensors],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        return cls._layout(d["version"], d["bucket_bytes"], [(n, dt, sh) for n, dt, sh in d["tensors"]])


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only if it was not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _crc(payload: torch.Tensor) -> int:
    # zlib reads host memory; a GPU bucket pays one device-to-host copy for its checksum.
    return crc32(payload.cpu().numpy()) if payload.numel() else 0


class BucketPacker:
    """Sender side: cuts a version's tensors into wire buckets. Does not modify the tensors."""

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        self.manifest = manifest
        self._bytes = {s.name: byte_view(tensors[s.name]) for s in manifest.tensors}
        self._host_crc = all(v.device.type == "cpu" for v in self._bytes.values())

    def pack(self, index: int, out: torch.Tensor) -> torch.Tensor:
        """Writes bucket `index` (payload + footer) into the front of `out`; returns that view."""
        n = self.manifest.wire_bytes(index) - FOOTER.size
        wire = out[: n + FOOTER.size]
        crc = 0
        for spec, (ta, tb), (ba, bb) in self.manifest.pieces(index):
            src = self._bytes[spec.name][ta:tb]
            wire[ba:bb].copy_(src)
            if self._host_crc:
                # Chained over the source pieces (equal to the CRC of the packed payload): a
                # fault in the pack copy is caught too, and a GPU bucket needs no copy back.
                crc = crc32(src.numpy(), crc)
        if not self._host_crc:
            crc = _crc(wire[:n])
        footer = FOOTER.pack(crc, index, self.manifest.version)
        wire[n:].copy_(torch.frombuffer(bytearray(footer), dtype=torch.uint8))
        return wire


class BucketUnpacker:
    """Receiver side: checks each wire bucket and copies it into the staging tensors.

    Mutates `staging` (allocated here when not given). A bucket whose footer or CRC does not
    match is recorded in `bad` and not copied; `is_verified` holds only when every bucket
    arrived and matched.
    """

    def __init__(self, manifest: Manifest, staging: dict[str, torch.Tensor] | None = None, device="cpu"):
        self.manifest = manifest
        if staging is None:
            staging = {
                s.name: torch.empty(s.shape, dtype=_DTYPES[s.dtype], device=device) for s in manifest.tensors
            }
        names = {s.name for s in manifest.tensors}
        if set(staging) != names:
            raise ValueError(f"staging names differ from the manifest: {sorted(set(staging) ^ names)[:5]}")
        for s in manifest.tensors:
            t = staging[s.name]
            if str(t.dtype).removeprefix("torch.") != s.dtype or tuple(t.shape) != s.shape or not t.is_contiguous():
                raise ValueError(f"staging {s.name}: want contiguous {s.dtype}{list(s.shape)}, got {t.dtype}{list(t.shape)}")
        self.staging = staging
        self._bytes = {n: byte_view(t) for n, t in staging.items()}
        self.num_unpacked = 0
        self.bad: list[int] = []

    def unpack(self, index: int, wire: torch.Tensor) -> bool:
        """Checks bucket `index` and, if it matches, copies it into staging; returns the match."""
        n = self.manifest.wire_bytes(index) - FOOTER.size
        assert wire.numel() == n + FOOTER.size, (wire.numel(), n)
        crc, got_index, got_version = FOOTER.unpack(bytes(wire[n:].cpu().numpy()))
        self.num_unpacked += 1
        if (got_index, got_version) != (index, self.manifest.version) or crc != _crc(wire[:n]):
            self.bad.append(index)
            return False
        for spec, (ta, tb), (ba, bb) in self.manifest.pieces(index):
            self._bytes[spec.name][ta:tb].copy_(wire[ba:bb])
        return True

    @property
    def is_verified(self) -> bool:
        return not self.bad and self.num_unpacked == self.manifest.num_buckets


class FlatVersion:
    """A version as one flat byte buffer in manifest order, each bucket's CRC32 computed once.

    The sender's side of the split wire format: a broadcast sends the bucket checksums in its
    header and then payload slices straight from the buffer, so nothing is packed or
    checksummed per send. The receiver's side: `empty(manifest)` (or a warm buffer) takes
    the payloads, `check_crc` verifies one bucket in place, `tensors` are views of it — no
    unpacking copy.
    """

    def __init__(self, manifest: Manifest, buf: torch.Tensor, crcs: list[int] | None = None) -> None:
        assert buf.dtype == torch.uint8 and buf.numel() == manifest.total_bytes and buf.is_contiguous()
        self.manifest, self.buf, self.crcs = manifest, buf, crcs

    @classmethod
    def from_tensors(cls, version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> FlatVersion:
        manifest = Manifest.build(version, tensors, bucket_bytes)
        buf = torch.empty(manifest.total_bytes, dtype=torch.uint8)
        for s in manifest.tensors:
            buf[s.offset:s.offset + s.nbytes].copy_(byte_view(tensors[s.name]).cpu())
        flat = cls(manifest, buf)
        flat.crcs = [_crc(flat.payload(i)) for i in range(manifest.num_buckets)]
        return flat

    @classmethod
    def empty(cls, manifest: Manifest, device="cpu") -> FlatVersion:
        return cls(manifest, torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device))

    def payload(self, index: int) -> torch.Tensor:
        a, b = self.manifest.bucket_range(index)
        return self.buf[a:b]

    def payloads(self, first: int, count: int) -> torch.Tensor:
        """The payloads of buckets first .. first+count-1 (fewer at the end), end to end."""
        a, _ = self.manifest.bucket_range(first)
        _, b = self.manifest.bucket_range(min(first + count, self.manifest.num_buckets) - 1)
        return self.buf[a:b]

    def check_crc(self, index: int, crc: int) -> bool:
        """Whether the payload of bucket `index` matches the sender's CRC32 `crc`."""
        return crc == _crc(self.payload(index))

    def tensors(self, aligned_only: bool = False) -> dict[str, torch.Tensor]:
        """Views of the buffer (a copy only for a tensor whose offset is not aligned to its
        element size; `aligned_only` leaves those out: a copy needs the final bytes)."""
        out = {}
        for s in self.manifest.tensors:
            dtype = _DTYPES[s.dtype]
            raw = self.buf[s.offset:s.offset + s.nbytes]
            if s.offset % dtype.itemsize:
                if aligned_only:
                    continue
                raw = raw.clone()
            out[s.name] = raw.view(dtype).reshape(s.shape)
        return out

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes

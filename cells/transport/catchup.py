"""Point-to-point catch-up of one cell to a weight version, over a `PairChannel`.

One line: manifest (JSON) → buckets (next in flight while the previous is staged) → the
receiver's verdict back. Used by a cell that missed a broadcast (failed, late, or entering
`loading`); the same bucket format and CRC32 footers as the broadcast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cells.transport.buckets import (
    DEFAULT_BUCKET_BYTES,
    FOOTER,
    BucketPacker,
    BucketUnpacker,
    ChecksumError,
    Manifest,
)
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.staging import StagingBuffers


def send_version_p2p(
    channel: PairChannel, version: int, tensors: dict[str, torch.Tensor],
    *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Catch-up of one cell: sends `version` over `channel`; raises ChecksumError if the peer
    refused a bucket, TransferError on a transport failure."""
    manifest = Manifest.build(version, tensors, bucket_bytes)
    packer = BucketPacker(manifest, tensors)
    channel.send_json({"manifest": manifest.to_dict()})
    bufs = [torch.empty(bucket_bytes + FOOTER.size, dtype=torch.uint8, device=channel.device) for _ in range(2)]
    _p2p_pipeline(manifest.num_buckets, lambda i: channel.isend(packer.pack(i, bufs[i % 2])), lambda i: None)
    reply = channel.recv_json()
    if not reply.get("ok"):
        raise ChecksumError(f"{channel.name}: peer refused version {version}: buckets {reply.get('bad')}")


def recv_version_p2p(
    channel: PairChannel, *, staging: dict[str, torch.Tensor] | None = None,
    bucket_hook: Callable[[int, torch.Tensor], None] | None = None, buffers: StagingBuffers | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    """Receives a version sent by `send_version_p2p` into `staging` (mutated; when None, into
    a warm buffer of `buffers` where one is free, else fresh tensors); returns (version,
    tensors) only after every bucket's CRC matched."""
    msg = channel.recv_json()
    try:
        manifest = Manifest.from_dict(msg["manifest"])
    except (KeyError, TypeError, ValueError) as e:  # a peer speaking another protocol
        channel.close()
        raise TransferError(f"{channel.name}: malformed manifest: {e!r}") from e
    if staging is None and buffers is not None:
        staging = buffers.flat(manifest, channel.device).tensors()
    unpacker = BucketUnpacker(manifest, staging, channel.device)
    bufs = [torch.empty(manifest.bucket_bytes + FOOTER.size, dtype=torch.uint8, device=channel.device)
            for _ in range(2)]
    wire = lambda i: bufs[i % 2][: manifest.wire_bytes(i)]

    def finish(i: int) -> None:
        if bucket_hook is not None:
            bucket_hook(i, wire(i))
        unpacker.unpack(i, wire(i))

    _p2p_pipeline(manifest.num_buckets, lambda i: channel.irecv(wire(i)), finish)
    channel.send_json({"ok": unpacker.is_verified, "bad": unpacker.bad[:64]})
    if not unpacker.is_verified:
        raise ChecksumError(f"{channel.name}: checksum mismatch in buckets {unpacker.bad[:8]}")
    return manifest.version, unpacker.staging


def _p2p_pipeline(num_buckets: int, post, finish) -> None:
    transfers = {i: post(i) for i in range(min(2, num_buckets))}
    for i in range(num_buckets):
        transfers.pop(i).wait()  # the channel's own op timeout
        finish(i)
        if i + 2 < num_buckets:
            transfers[i + 2] = post(i + 2)

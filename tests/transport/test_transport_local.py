"""Bucket layout, CRC footers, group joins and the broadcast control exchange, in one
process (no peers needed)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed import PrefixStore

from cells.transport.broadcast import WeightReceiver, WeightSender
from cells.transport.buckets import FOOTER, BucketPacker, BucketUnpacker, Manifest
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.store import StoreHost, wait_json, wait_keys


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(30, 7, generator=g),
        "b": torch.randn(11, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "flags": torch.rand(9, generator=g) > 0.5,
        "t": torch.randn(8, 8, generator=g).t(),  # not contiguous
    }


def _send_all(manifest: Manifest, tensors, corrupt=None) -> BucketUnpacker:
    packer, unpacker = BucketPacker(manifest, tensors), BucketUnpacker(manifest)
    buf = torch.empty(manifest.bucket_bytes + FOOTER.size, dtype=torch.uint8)
    for i in range(manifest.num_buckets):
        wire = packer.pack(i, buf).clone()
        if corrupt is not None:
            corrupt(i, wire)
        unpacker.unpack(i, wire)
    return unpacker


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1 << 20])
def test_buckets_round_trip_bitwise_at_any_cut(bucket_bytes):
    tensors = _tensors()
    manifest = Manifest.build(7, tensors, bucket_bytes)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    unpacker = _send_all(manifest, tensors)
    assert unpacker.is_verified
    for name, t in tensors.items():
        assert unpacker.staging[name].dtype == t.dtype and torch.equal(unpacker.staging[name], t)


def test_flipped_bit_and_misplaced_bucket_are_refused():
    tensors = _tensors()
    manifest = Manifest.build(7, tensors, 64)

    def flip(i, wire):
        if i == 3:
            wire[5] ^= 1

    unpacker = _send_all(manifest, tensors, flip)
    assert not unpacker.is_verified and unpacker.bad == [3]
    other = Manifest.build(8, tensors, 64)  # same bytes, another version's footer
    wire = BucketPacker(other, tensors).pack(0, torch.empty(64 + FOOTER.size, dtype=torch.uint8))
    assert BucketUnpacker(manifest).unpack(0, wire) is False


def test_staging_must_match_the_manifest():
    tensors = _tensors()
    manifest = Manifest.build(1, tensors, 64)
    staging = {k: torch.empty_like(v.contiguous()) for k, v in tensors.items()}
    BucketUnpacker(manifest, staging)  # matching staging is accepted and written in place
    with pytest.raises(ValueError):
        BucketUnpacker(manifest, {**staging, "a": torch.empty(30, 7, dtype=torch.float64)})
    with pytest.raises(ValueError):
        BucketUnpacker(manifest, {k: v for k, v in staging.items() if k != "a"})


def test_channel_without_peer_and_reused_name_fail_fast():
    host = StoreHost()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="joined"):
            PairChannel(host.store, "lonely", 0, connect_timeout_s=0.3)
        assert time.monotonic() - t0 < 2.0
        PrefixStore("pair/used/", host.store).add("joined", 2)  # an earlier attempt's pair
        with pytest.raises(TransferError, match="fresh name"):
            PairChannel(host.store, "used", 0, connect_timeout_s=0.3)
        assert wait_keys(host.store, ["missing"], 0.05) == []
        assert wait_json(host.store, "missing", 0.05) is None
    finally:
        host.close()


def test_broadcast_control_exchange_without_peers():
    host = StoreHost()
    try:
        tensors = _tensors()
        sender = WeightSender(host.store, join_timeout_s=0.2, timeout_s=1.0)
        res = sender.send_version(9, tensors, ["ghost"])
        assert res.delivered == [] and res.failed == {"ghost": "did not join"}, res
        with pytest.raises(ValueError, match="already broadcast"):
            sender.send_version(9, tensors, ["ghost"])  # a version's keys are single-use
        rx = WeightReceiver(host.store, "ghost", join_timeout_s=0.2)
        assert rx.receive_version(9) is False  # planned without it: catch up p2p instead
        assert "not in the plan" in rx.last_error
        assert rx.receive_version(10) is False  # no sender at all
        with pytest.raises(TransferError, match="no verified version"):
            rx.received_tensors()
    finally:
        host.close()


def test_discard_leaves_the_destructor_to_its_reaper():
    """Whoever drops a backend's last reference runs its destructor (gloo joins its threads
    and closes its sockets: tens of ms). A caller that drops its own reference right after
    `discard` leaves it to the reaper, which lets go only after its shutdown (a few ms on
    gloo), never before."""
    import threading

    from cells.transport.p2p import discard

    seen: list[str] = []

    class Backend:
        def shutdown(self):
            time.sleep(0.02)

        def abort(self):
            time.sleep(0.02)

        def __del__(self):
            seen.append(threading.current_thread().name)

    for broken in (False, True):
        backend = Backend()
        discard(backend, [torch.zeros(4)], broken=broken)
        backend = None
        deadline = time.monotonic() + 10
        while len(seen) < (1 if not broken else 2) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seen == ["transport-reap", "transport-reap"]

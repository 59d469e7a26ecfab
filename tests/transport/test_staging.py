"""Warm staging buffers (cells/transport/staging.py) and the receive thread's OS priority
(cells/versions.py), in one process."""

from __future__ import annotations

import os
import threading

import torch

from cells.transport import staging as staging_mod
from cells.transport.buckets import FlatVersion, Manifest
from cells.transport.staging import StagingBuffers
from cells.versions import RECEIVE_NICE, lower_priority


def _version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(8, 4, generator=g), "k": torch.randn(4, 4, generator=g),
            "n": torch.randn(4, generator=g).to(torch.bfloat16), "ids": torch.arange(5)}


def _receive(pool: StagingBuffers, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver does: the sender's bytes land in a pool buffer, checked, then viewed."""
    sent = FlatVersion.from_tensors(1, tensors, bucket_bytes=24)
    flat = pool.flat(sent.manifest)
    flat.buf.copy_(sent.buf)
    assert all(flat.check_crc(i, sent.crcs[i]) for i in range(sent.manifest.num_buckets))
    return flat.tensors()


def test_a_buffer_is_reused_only_once_nothing_refers_to_it_and_weights_stay_bitwise():
    pool = StagingBuffers(max_buffers=2)
    held = {1: _receive(pool, _version(1))}
    held[2] = _receive(pool, _version(2))  # version 1 still held: a second buffer
    assert (pool.num_allocated, pool.num_reused) == (2, 0)
    derived = held[1]["q"].detach()  # an engine keeps derived views, not ours
    del held[1]
    held[3] = _receive(pool, _version(3))  # version 1's buffer is still referenced
    assert (pool.num_allocated, pool.num_reused) == (3, 0)
    del derived, held[2]
    for v in (4, 5, 6):  # from here on, only warm buffers
        held[v] = _receive(pool, _version(v))
        for old in [k for k in held if k < v]:
            del held[old]
    assert (pool.num_allocated, pool.num_reused) == (3, 3)
    want = _version(6)
    assert all(torch.equal(held[6][k], want[k]) and held[6][k].dtype == want[k].dtype for k in want)


def test_a_buffer_of_another_size_is_replaced():
    pool = StagingBuffers(max_buffers=1)
    m1 = Manifest.build(1, {"a": torch.zeros(10)}, 16)
    m2 = Manifest.build(2, {"a": torch.zeros(12)}, 16)
    pool.flat(m1)
    f2 = pool.flat(m2)
    assert f2.buf.numel() == 48 and pool.num_allocated == 2
    del f2
    assert pool.flat(m2).buf.numel() == 48 and pool.num_reused == 1


def test_without_a_storage_count_every_buffer_is_fresh(monkeypatch):
    monkeypatch.setattr(staging_mod, "_OWN", None)
    pool = StagingBuffers()
    for _ in range(3):
        t = pool.take(64)
        del t
    assert (pool.num_allocated, pool.num_reused) == (3, 0)


def test_receive_priority_applies_to_the_thread_and_what_it_starts():
    got: dict[str, object] = {}

    def loader() -> None:
        got["ok"] = lower_priority(RECEIVE_NICE)
        got["own"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(target=lambda: got.update(child=os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=loader)
    t.start()
    t.join()
    if base <= RECEIVE_NICE:
        assert got == {"ok": True, "own": RECEIVE_NICE, "child": RECEIVE_NICE}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # this thread untouched


def test_a_priority_that_is_not_allowed_falls_back_quietly(monkeypatch):
    def refuse(*a):
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "setpriority", refuse)
    assert lower_priority(RECEIVE_NICE) is False
    monkeypatch.delattr(os, "setpriority")
    assert lower_priority(RECEIVE_NICE) is False


def test_views_prepared_before_the_bytes_land_see_the_final_bytes():
    """A split receive prepares its tensors after the first op, while later ops are in flight:
    a tensor at an unaligned offset (a copy, not a view) must be taken only at `finish`."""
    from cells.transport.staging import FlatReceipt

    want = {"b": torch.arange(3, dtype=torch.uint8), "f": torch.randn(5), "h": torch.randn(3).to(torch.float16)}
    sent = FlatVersion.from_tensors(1, want, bucket_bytes=8)
    flat = FlatVersion.empty(sent.manifest)
    assert any(s.offset % want[s.name].element_size() for s in sent.manifest.tensors)  # the case at hand
    receipt = FlatReceipt(flat, None)
    receipt.prepare()  # nothing has arrived yet
    flat.buf.copy_(sent.buf)
    receipt.num_unpacked = sent.manifest.num_buckets
    receipt.finish()
    got = receipt.staging
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), got

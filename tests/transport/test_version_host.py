"""The trainer's version host between real processes over gloo: broadcast, catch-up of a late
joiner, refusal of a version not held, concurrent catch-ups, clients that die before their
request or mid-transfer, and the host's own copy of every version.

The test process is the trainer (it owns the `VersionHost`); cells are worker processes
running this file (`transport_harness.Pool`: roles and results as JSON lines, nothing
pickled), one role after another, so each pays the torch import once.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from transport_harness import OP_TIMEOUT_S, Pool, make_tensors, serve  # noqa: E402

from cells.transport.p2p import PairChannel, TransferError  # noqa: E402
from cells.transport.receive import VersionUnavailable, fetch_version, receive_broadcast  # noqa: E402
from cells.transport.store import StoreAddress, connect, set_json  # noqa: E402
from cells.transport.versions_host import VersionHost  # noqa: E402

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

BUCKET_BYTES = 32 << 10
"""About ten buckets for the ~290 KB toy version, so the pipeline really runs."""
REQUEST_TIMEOUT_S = 3.0
"""Long against one catch-up of the toy version, so a later client is provably served while
an abandoned ticket is still pending."""
SLACK_S = 3.0
"""Scheduling slack on a loaded 2-core machine on top of an op timeout."""
WORKERS = ("w0", "w1", "w2")


# -- worker side (runs in the worker processes) ---------------------------------------------

def _equal(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k])
        for k in want
    )


def _address(a: dict) -> StoreAddress:
    return StoreAddress("127.0.0.1", a["port"])


def role_ping(a: dict) -> dict:
    return {"pid": os.getpid()}


def role_receive(a: dict) -> dict:
    tensors, error = receive_broadcast(_address(a), a["cell"], a["version"], timeout_s=OP_TIMEOUT_S,
                                       join_timeout_s=20.0)
    equal = tensors is not None and _equal(tensors, make_tensors(a["version"]))
    return {"ok": tensors is not None, "equal": equal, "error": error}


_WARM: dict = {}
"""This worker's warm staging buffers and the versions it still holds (as an engine would)."""


def role_receive_warm(a: dict) -> dict:
    """Receives into warm buffers (or catches up point-to-point into them) while holding the
    version received before, as an engine serves it; every held version must stay bitwise right."""
    from cells.transport.staging import StagingBuffers

    pool = _WARM.setdefault("pool", StagingBuffers(max_buffers=2))
    held = _WARM.setdefault("held", {})
    for v in sorted(held)[:-1]:  # the engine serves the newest one only
        del held[v]
    if a.get("fetch"):
        got, error = fetch_version(_address(a), a["cell"], a["version"], timeout_s=OP_TIMEOUT_S,
                                   connect_timeout_s=20.0, buffers=pool), None
    else:
        got, error = receive_broadcast(_address(a), a["cell"], a["version"], timeout_s=OP_TIMEOUT_S,
                                       join_timeout_s=20.0, buffers=pool)
    if got is not None:
        held[a["version"]] = got
    equal = all(_equal(t, make_tensors(v)) for v, t in held.items())
    return {"ok": got is not None, "equal": equal, "error": error, "reused": pool.num_reused,
            "allocated": pool.num_allocated}


def role_fetch(a: dict) -> dict:
    t0 = time.monotonic()
    try:
        tensors = fetch_version(_address(a), a["cell"], a["version"], timeout_s=OP_TIMEOUT_S,
                                connect_timeout_s=20.0)
    except TransferError as e:
        return {"kind": type(e).__name__, "error": str(e), "elapsed": time.monotonic() - t0}
    return {"kind": None, "equal": _equal(tensors, make_tensors(a["seed"])), "elapsed": time.monotonic() - t0}


def role_take_ticket(a: dict) -> dict:
    """A client that dies between taking its ticket and writing its request."""
    return {"ticket": connect(_address(a), timeout_s=20).add("versions/catchup/next", 1)}


def role_die_mid_fetch(a: dict) -> dict:
    """A client that joins its channel, reads the header and manifest, and dies."""
    store = connect(_address(a), timeout_s=20)
    n = store.add("versions/catchup/next", 1)
    set_json(store, f"versions/catchup/req/{n}", {"cell": a["cell"], "version": a["version"]})
    ch = PairChannel(store, f"versions/catchup/{n}", 1, timeout_s=OP_TIMEOUT_S, connect_timeout_s=20)
    ch.recv_json()
    ch.recv_json()
    os._exit(5)


# -- test side -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host():
    h = VersionHost("127.0.0.1", 0, bucket_bytes=BUCKET_BYTES, timeout_s=OP_TIMEOUT_S,
                    join_timeout_s=20.0, request_timeout_s=REQUEST_TIMEOUT_S)
    h.start()
    try:
        yield h
    finally:
        t0 = time.monotonic()
        h.close()
        assert time.monotonic() - t0 < 10.0


@pytest.fixture(scope="module")
def workers(host, tmp_path_factory):
    w = Pool(host.address.port, tmp_path_factory.mktemp("version_host_workers"), script=__file__)
    try:
        for name in WORKERS:
            w.submit(name, "ping")
        for name in WORKERS:
            assert "pid" in w.result(name, timeout_s=120), name
        yield w
    finally:
        exitcodes = w.close()
    # A worker that tore down broken channels must still exit cleanly (no abort at exit).
    assert all(rc == 0 for rc in exitcodes.values()), exitcodes


def _wait_stat(host: VersionHost, key: str, at_least: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = host.catchup_stats()
        if stats[key] >= at_least or time.monotonic() >= deadline:
            return stats
        time.sleep(0.02)


def _settled(host: VersionHost, timeout_s: float = OP_TIMEOUT_S + SLACK_S) -> dict:
    """The host's counts once every dispatched ticket has an outcome: a client that has its
    version may finish before the host's worker counts the ticket, so a baseline read right
    after the previous test could miss that count."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = host.catchup_stats()
        if s["dispatched"] == s["served"] + s["refused"] + s["failed"] or time.monotonic() >= deadline:
            return s
        time.sleep(0.02)


def _fetch(workers: Pool, name: str, version: int, seed: int | None = None) -> None:
    workers.submit(name, "fetch", cell=f"cell-{name}", version=version, seed=version if seed is None else seed)


@pytest.mark.parametrize("version,op_buckets", [(1, None), (21, 3)])
def test_broadcast_to_two_receivers_is_bitwise_equal(host, workers, version, op_buckets):
    """Default ops (the whole toy version in one) and ops of 3 buckets (the last one short)."""
    saved = host.op_bytes
    host.op_bytes = saved if op_buckets is None else op_buckets * BUCKET_BYTES
    try:
        host.put(version, make_tensors(version))
        for name in ("w0", "w1"):
            workers.submit(name, "receive", cell=f"cell-{name}", version=version)
        res = host.broadcast(version, ["cell-w0", "cell-w1"])
    finally:
        host.op_bytes = saved
    assert sorted(res.delivered) == ["cell-w0", "cell-w1"] and res.failed == {}, res
    for name in ("w0", "w1"):
        r = workers.result(name)
        assert r == {"ok": True, "equal": True, "error": None}, (name, r)


def test_warm_buffers_are_reused_across_versions_and_stay_bitwise(host, workers):
    results = []
    for v, fetch in ((11, False), (12, False), (13, False), (14, True), (15, False)):
        host.put(v, make_tensors(v))
        workers.submit("w2", "receive_warm", cell="cell-w2", version=v, fetch=fetch)
        if not fetch:
            res = host.broadcast(v, ["cell-w2"])
            assert res.delivered == ["cell-w2"], res
        results.append(workers.result("w2"))
        host.drop(v)
    assert all(r["ok"] and r["equal"] for r in results), results
    # two buffers warm up (the version held and the one received), then only reuse
    assert [(r["allocated"], r["reused"]) for r in results] == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)], results


def test_late_joiner_catches_up_point_to_point(host, workers):
    host.put(2, make_tensors(2))
    workers.submit("w0", "receive", cell="cell-w0", version=2)
    res = host.broadcast(2, ["cell-w0"])
    assert res.delivered == ["cell-w0"], res
    assert workers.result("w0")["equal"] is True
    _fetch(workers, "w1", 2)  # was not in the broadcast at all
    r = workers.result("w1")
    assert r["kind"] is None and r["equal"] is True, r


def test_version_not_held_is_refused_and_the_next_client_is_served(host, workers):
    host.put(3, make_tensors(3))
    _fetch(workers, "w0", 99)
    r = workers.result("w0")
    assert r["kind"] == VersionUnavailable.__name__, r
    assert f"version 99 is not held (held: {host.versions()})" in r["error"], r
    _fetch(workers, "w1", 3)
    r = workers.result("w1")
    assert r["kind"] is None and r["equal"] is True, r


def test_three_concurrent_catchups_all_succeed(host, workers):
    host.put(4, make_tensors(4))
    served = _settled(host)["served"]
    for name in WORKERS:
        _fetch(workers, name, 4)
    for name in WORKERS:
        r = workers.result(name)
        assert r["kind"] is None and r["equal"] is True, (name, r)
    assert _wait_stat(host, "served", served + 3, SLACK_S)["served"] == served + 3


def test_ticket_without_request_does_not_block_later_clients(host, workers):
    skipped = _settled(host)["skipped"]
    workers.submit("w0", "take_ticket")
    assert workers.result("w0")["ticket"] > 0
    _fetch(workers, "w1", 4)
    r = workers.result("w1")
    assert r["kind"] is None and r["equal"] is True, r
    assert host.catchup_stats()["skipped"] == skipped  # served while the dead ticket still waited
    stats = _wait_stat(host, "skipped", skipped + 1, REQUEST_TIMEOUT_S + SLACK_S)
    assert stats["skipped"] == skipped + 1, stats


def test_put_keeps_its_own_copy_and_drop_spares_a_transfer_in_flight(host, workers):
    mine = make_tensors(5)
    host.put(5, mine)
    for t in mine.values():
        t.zero_() if t.dtype != torch.bool else t.logical_not_()  # the next "training step"
    _fetch(workers, "w0", 5)
    r = workers.result("w0")
    assert r["kind"] is None and r["equal"] is True, r  # what was put, not what it became
    dispatched = _settled(host)["dispatched"]
    _fetch(workers, "w1", 5)
    assert _wait_stat(host, "dispatched", dispatched + 1, 20)["dispatched"] == dispatched + 1
    host.drop(5)  # while (or just after) the worker sends it
    r = workers.result("w1")
    assert r["kind"] is None and r["equal"] is True, r
    assert 5 not in host.versions()
    _fetch(workers, "w1", 5)
    assert workers.result("w1")["kind"] == VersionUnavailable.__name__


def test_client_dying_mid_transfer_fails_only_its_own_worker(host, workers):
    failed = _settled(host)["failed"]
    workers.submit("w2", "die_mid_fetch", cell="cell-w2", version=4)
    _fetch(workers, "w0", 4)  # concurrently with the doomed one
    r = workers.result("w0")
    assert r["kind"] is None and r["equal"] is True, r
    assert workers.result("w2")["exitcode"] == 5
    stats = _wait_stat(host, "failed", failed + 1, OP_TIMEOUT_S + SLACK_S)
    assert stats["failed"] == failed + 1, stats
    _fetch(workers, "w1", 4)  # the server goes on serving
    r = workers.result("w1")
    assert r["kind"] is None and r["equal"] is True, r


def test_versions_bookkeeping_in_process():
    h = VersionHost(bucket_bytes=BUCKET_BYTES, timeout_s=1.0)
    try:
        t = make_tensors(7)
        h.put(7, t)
        h.put(7, make_tensors(7))  # the same bytes again: a no-op
        with pytest.raises(ValueError, match="different content"):
            h.put(7, make_tensors(8))
        assert h.versions() == [7]
        assert h.nbytes(7) == sum(v.numel() * v.element_size() for v in t.values())
        held = h.get(7)
        assert all(held[k].is_contiguous() for k in t)
        assert all(held[k].data_ptr() != t[k].data_ptr() for k in t if t[k].numel())
        with pytest.raises(KeyError, match=r"version 8 is not held \(held: \[7\]\)"):
            h.drop(8)
        with pytest.raises(KeyError, match="not held"):
            h.broadcast(8, ["c0"])
        with pytest.raises(KeyError, match="not held"):
            h.get(8)
        with pytest.raises(ValueError, match="unsupported dtype"):
            h.put(9, {"z": torch.zeros(2, dtype=torch.complex64)})
        with pytest.raises(ValueError, match="non-negative"):
            h.put(-1, t)
        h.drop(7)
        assert h.versions() == []
        h.start()
        address = h.address
    finally:
        t0 = time.monotonic()
        h.close()
        h.close()
        assert time.monotonic() - t0 < 3.0
    # a host that is gone: an exception for the catch-up, a reason for the broadcast
    with pytest.raises(TransferError, match="unreachable"):
        fetch_version(address, "c0", 7, timeout_s=0.5)
    tensors, error = receive_broadcast(address, "c0", 7, timeout_s=0.5, join_timeout_s=0.5)
    assert tensors is None and "unreachable" in error


if __name__ == "__main__":
    serve(globals())

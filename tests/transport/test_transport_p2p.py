"""PairChannel between real processes over gloo: round trips, a dead peer, a stalled peer."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from transport_harness import OP_TIMEOUT_S, Pool  # noqa: E402

from cells.transport.store import StoreHost, wait_keys  # noqa: E402

pytestmark = pytest.mark.slow
SLACK_S = 2.0
"""Scheduling slack on a loaded 2-core machine on top of the op timeout."""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    host = StoreHost("127.0.0.1", 0)
    p = Pool(host.address.port, tmp_path_factory.mktemp("p2p_workers"))
    p.store = host.store
    try:
        yield p
    finally:
        exitcodes = p.close()
        host.close()
    # A worker that tore down broken channels must still exit cleanly (no abort at exit).
    assert all(rc == 0 for rc in exitcodes.values()), exitcodes


def test_tensors_and_json_round_trip_bitwise(pool):
    for rank in (0, 1):
        pool.submit(f"rank{rank}", "p2p_roundtrip", rank=rank)
    results = [pool.result(f"rank{rank}") for rank in (0, 1)]
    for r in results:
        assert r.get("ok") is True, r
        assert r["raw_gbps"] > 0 and r["chunked_gbps"] > 0, r
    assert results[0]["raw_gbps"] == results[1]["raw_gbps"]  # both ranks report one number


def test_dead_peer_raises_within_timeout_and_a_fresh_channel_works(pool):
    pool.submit("rank0", "p2p_survivor")
    pool.submit("dying", "p2p_dying_peer")
    pool.submit("rank1", "p2p_echo", channel="die/2")
    r = pool.result("rank0")
    assert r.get("error"), r
    assert r["elapsed"] < OP_TIMEOUT_S + SLACK_S, r
    assert r["refused"] is True, r  # the broken channel refuses further ops at once
    assert r["fresh_ok"] is True, r
    assert pool.result("dying")["exitcode"] == 3
    assert pool.result("rank1").get("ok") is True


def test_stalled_peer_times_out_on_the_waiting_side(pool):
    peer = pool.submit("rank1", "p2p_stall_peer")
    pool.submit("rank0", "p2p_stall_waiter")
    assert wait_keys(pool.store, ["stall/ready"], 60), "stall peer never came up"
    os.kill(peer.pid, signal.SIGSTOP)  # our own worker: alive, but it moves no bytes
    try:
        pool.store.set("stall/go", "1")
        t0 = time.monotonic()
        r = pool.result("rank0", timeout_s=4 * OP_TIMEOUT_S + 20)
        assert time.monotonic() - t0 < 2 * (OP_TIMEOUT_S + SLACK_S) + 5, r
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        pool.store.set("stall/release", "1")
    for op in ("recv", "send"):
        assert r[op]["error"] and "timed out" in r[op]["error"].lower(), r
        assert OP_TIMEOUT_S - 0.5 <= r[op]["elapsed"] < OP_TIMEOUT_S + SLACK_S, r
    assert pool.result("rank1").get("released") is True

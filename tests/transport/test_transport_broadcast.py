"""Versioned weight broadcast between real processes over gloo: delivery, checksums, a dead
sender, a dead receiver, and a late joiner that catches up point-to-point."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from transport_harness import OP_TIMEOUT_S, Pool  # noqa: E402

from cells.transport.store import StoreHost, wait_keys  # noqa: E402

pytestmark = pytest.mark.slow
CELLS = ["c0", "c1", "c2"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    host = StoreHost("127.0.0.1", 0)
    p = Pool(host.address.port, tmp_path_factory.mktemp("broadcast_workers"))
    p.store = host.store
    try:
        yield p
    finally:
        exitcodes = p.close()
        host.close()
    assert all(rc == 0 for rc in exitcodes.values()), exitcodes


def _broadcast(pool, version: int, sender: dict | None = None, receivers: dict | None = None):
    pool.submit("sender", "bc_sender", version=version, seed=version, receivers=CELLS, **(sender or {}))
    for c in CELLS:
        pool.submit(c, "bc_receiver", cell=c, version=version, seed=version, **(receivers or {}).get(c, {}))
    return pool.result("sender"), {c: pool.result(c) for c in CELLS}


def test_broadcast_to_three_receivers_arrives_bitwise_verified(pool):
    sent, got = _broadcast(pool, 1)
    assert sorted(sent["delivered"]) == CELLS and sent["failed"] == {}, sent
    assert sent["num_attempts"] == 1, sent
    for c, r in got.items():
        assert r["complete"] and r["equal"] and not r["raises"], (c, r)


def test_flipped_bit_in_one_bucket_is_refused(pool):
    sent, got = _broadcast(pool, 2, receivers={"c1": {"corrupt_bucket": 2}})
    assert "checksum" in sent["failed"]["c1"], sent
    assert sorted(sent["delivered"]) == ["c0", "c2"], sent
    assert got["c1"]["complete"] is False and got["c1"]["raises"] is True, got["c1"]
    for c in ("c0", "c2"):  # one bad copy does not stop the others
        assert got[c]["complete"] and got[c]["equal"], (c, got[c])


def test_sender_dying_midway_leaves_no_receiver_complete(pool):
    sent, got = _broadcast(pool, 3, sender={"die_at_bucket": 3})
    assert sent["exitcode"] == 7, sent
    for c, r in got.items():
        assert r["complete"] is False and r["raises"] is True, (c, r)
        # bounded: the failed op, then the wait for a retry plan that never comes
        assert r["elapsed"] < 2 * OP_TIMEOUT_S + 3 + 2 + 5, (c, r)


def test_receiver_dying_midway_does_not_stop_the_others(pool):
    sent, got = _broadcast(pool, 4, receivers={"c2": {"die_at_bucket": 3}})
    assert got["c2"]["exitcode"] == 9
    assert sorted(sent["delivered"]) == ["c0", "c1"], sent
    assert "c2" in sent["failed"], sent
    # c2's death broke the collective for a live member, which got it on a fresh group
    assert sent["num_attempts"] == 2, sent
    for c in ("c0", "c1"):
        assert got[c]["complete"] and got[c]["equal"], (c, got[c])


def test_late_joiner_catches_up_point_to_point(pool):
    version = 5
    pool.submit("sender", "bc_sender", version=version, seed=version, receivers=["c0", "c1", "late"],
                join_timeout_s=2.0, catch_up=["late"])
    for c in ("c0", "c1"):
        pool.submit(c, "bc_receiver", cell=c, version=version, seed=version)
    # "late" shows up only after the broadcast has been planned without it
    assert wait_keys(pool.store, [f"bc/{version}/plan/0"], 60)
    pool.submit("c2", "bc_receiver", cell="late", version=version, seed=version, catch_up=True)
    sent = pool.result("sender")
    assert sorted(sent["delivered"]) == ["c0", "c1"] and "late" in sent["failed"], sent
    assert sent["caught_up"] == ["late"], sent
    late = pool.result("c2")
    assert late["complete"] is False and late["raises"] is True, late  # not from the broadcast
    assert late["p2p_version"] == version and late["p2p_equal"] is True, late
    for c in ("c0", "c1"):
        assert pool.result(c)["equal"] is True

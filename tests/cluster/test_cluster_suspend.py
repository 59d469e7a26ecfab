"""Suspension with the KV parked in host memory: a draining cell whose requests find no room
keeps their KV off its pool; once a cell has room they move on by KV migration, token-exact."""

import signal
import sqlite3
import time

import pytest

from .harness import Cluster
from .test_cluster_faults import _check_exact, _start

pytestmark = pytest.mark.slow


def _migrations(cluster):
    with sqlite3.connect(cluster.cfg["scheduler"]["db_path"], timeout=10) as db:
        return db.execute("SELECT src, dst, path, state, src_state FROM migrations").fetchall()


def _park_on_cell_0(tmp_path):
    """Two cells; cell-1 trains, so when cell-0 drains its request has nowhere to go."""
    c = Cluster(tmp_path, num_cells=2, scheduler__min_rollout_cells=0, scheduler__drain_deadline_s=1.0)
    try:
        assert c.wait_flip(c.flip("cell-1", "training")["id"], 60)["state"] == "done"
        prompts, streams = _start(c, 1, seed=7, max_tokens=900)
        flip = c.wait_flip(c.flip("cell-0", "training")["id"], 60)
        assert (flip["state"], flip["suspended"], flip["migrated"]) == ("done", 1, 0), flip
        return c, prompts, streams
    except BaseException:
        c.stop()
        raise


def test_parked_kv_moves_on_by_migration_when_room_returns(tmp_path):
    c, prompts, streams = _park_on_cell_0(tmp_path)
    try:
        time.sleep(0.5)  # tokens synced before the park have arrived
        n = len(streams[0].tokens)
        time.sleep(1.0)
        assert len(streams[0].tokens) == n < 900  # parked: nothing decodes it
        assert c.wait_flip(c.flip("cell-1", "rollout")["id"], 60)["state"] == "done"
        _check_exact(c, prompts, streams)
        moves = _migrations(c)
        assert ("cell-0", "cell-1", "kv", "committed", "parked") in moves, moves
        assert not any(m[2] == "reprefill" for m in moves), moves
    finally:
        c.stop()


def test_parked_copy_lost_is_re_prefilled_token_exact(tmp_path):
    c, prompts, streams = _park_on_cell_0(tmp_path)
    try:
        c.kill("cell-0", signal.SIGKILL)  # the host copy goes with its process
        c.wait(lambda: c.cell("cell-0")["state"] == "down", 30, "cell-0 fenced")
        assert c.wait_flip(c.flip("cell-1", "rollout")["id"], 60)["state"] == "done"
        _check_exact(c, prompts, streams)
        assert not any(m[4] == "parked" and m[3] == "committed" for m in _migrations(c))
    finally:
        c.stop()

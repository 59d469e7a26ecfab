"""Process faults around migration and leases: no request is lost, tokens stay exact."""

import random
import signal
import time

import pytest

from .harness import Cluster, Streamer, reference_tokens

pytestmark = pytest.mark.slow

N_TOKENS = 100


def _start(cluster, n, seed, max_tokens=N_TOKENS):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1024) for _ in range(rng.randrange(40, 120))] for _ in range(n)]
    streams = [Streamer(cluster.url, p, max_tokens=max_tokens, seed=seed * 100 + i, token=cluster.agent_token) for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    cluster.wait(lambda: all(len(s.tokens) >= 5 for s in streams), 90, "tokens flowing")
    return prompts, streams


def _check_exact(cluster, prompts, streams):
    for s in streams:
        s.join(180)
    for s, p in zip(streams, prompts):
        assert s.error is None, (s.error, cluster.logs())
        assert len(s.tokens) == s.max_tokens, (s.request_id, len(s.tokens), cluster.logs())
        assert s.tokens == reference_tokens(cluster.cfg, s.request_id, p, s.max_tokens, s.seed), s.request_id


def _busiest(cluster):
    return max(cluster.cells(), key=lambda c: c["inflight"])["id"]


def test_destination_killed_before_commit_source_keeps_decoding(tmp_path):
    # cells 1 and 2 die when they are about to commit an imported request
    env = {i: {"CELLFLIP_FAILPOINTS": "migrate.before_commit=kill"} for i in (1, 2)}
    c = Cluster(tmp_path, num_cells=3, cell_env=env)
    try:
        # every request on cell-0: the other two train while the requests start
        for i in (1, 2):
            assert c.wait_flip(c.flip(f"cell-{i}", "training")["id"], 60)["state"] == "done"
        prompts, streams = _start(c, 3, seed=2, max_tokens=1500)  # long enough to outlive two flips
        for i in (1, 2):
            assert c.wait_flip(c.flip(f"cell-{i}", "rollout")["id"], 60)["state"] == "done"
        flip = c.flip("cell-0", "training")
        c.wait(lambda: any(c.procs[f"cell-{i}"].poll() is not None for i in (1, 2)), 60,
               "a destination killed at its commit")
        c.wait_flip(flip["id"], 120)
        _check_exact(c, prompts, streams)
    finally:
        c.stop()


def test_source_killed_after_stop_and_copy_request_continues_elsewhere(tmp_path):
    env = {i: {"CELLFLIP_FAILPOINTS": "migrate.after_stop_copy=kill"} for i in range(3)}
    c = Cluster(tmp_path, num_cells=3, cell_env=env)
    try:
        prompts, streams = _start(c, 3, seed=3, max_tokens=1500)  # still decoding when the flip lands
        victim = _busiest(c)
        flip = c.flip(victim, "training")
        c.wait(lambda: c.procs[victim].poll() is not None, 60, "source killed at the failpoint")
        c.wait_flip(flip["id"], 120)
        _check_exact(c, prompts, streams)
    finally:
        c.stop()


def test_stalled_cell_is_fenced_and_its_requests_resume_elsewhere(tmp_path):
    c = Cluster(tmp_path, num_cells=2)
    try:
        prompts, streams = _start(c, 3, seed=4, max_tokens=1000)  # outlives the stall
        victim = _busiest(c)
        inc = c.cell(victim)["incarnation"]
        c.kill(victim, signal.SIGSTOP)
        time.sleep(c.cfg["scheduler"]["lease_s"] * 2.5)
        c.kill(victim, signal.SIGCONT)  # the zombie wakes up: its late syncs must be refused
        _check_exact(c, prompts, streams)
        c.wait(lambda: c.cell(victim)["incarnation"] != inc, 30, "zombie re-registered as a new incarnation")
    finally:
        c.stop()


def test_scheduler_killed_mid_flip_restarts_and_finishes_every_request(tmp_path):
    c = Cluster(tmp_path, num_cells=3)
    try:
        prompts, streams = _start(c, 3, seed=5, max_tokens=600)
        victim = _busiest(c)
        flip = c.flip(victim, "training")
        c.kill("scheduler")  # SIGKILL right after the flip was recorded
        for s in streams:
            s.join(30)  # their streams die with the scheduler; the requests must not
        c.start_scheduler()
        state = c.wait_flip(flip["id"], 120)
        assert state["state"] in ("done", "rolled_back"), state
        for s, p in zip(streams, prompts):
            assert s.session_id, s.error
            got = c.wait(lambda s=s: (t := c.sampled_tokens(s.session_id)) and len(t) >= s.max_tokens and t,
                         180, f"{s.request_id} finished after the restart")
            assert got == reference_tokens(c.cfg, s.request_id, p, s.max_tokens, s.seed), s.request_id
        flips = c.http.get("/v1/flips").json()
        flips = flips["flips"] if isinstance(flips, dict) else flips
        assert sum(f["id"] == flip["id"] for f in flips) == 1  # never runs twice
    finally:
        c.stop()


def test_destination_failing_between_commit_and_resume_loses_nothing(tmp_path):
    # the import thread of cells 1 and 2 fails right after winning the commit
    env = {i: {"CELLFLIP_FAILPOINTS": "migrate.after_commit=1*raise"} for i in (1, 2)}
    c = Cluster(tmp_path, num_cells=3, cell_env=env)
    try:
        for i in (1, 2):
            assert c.wait_flip(c.flip(f"cell-{i}", "training")["id"], 60)["state"] == "done"
        prompts, streams = _start(c, 2, seed=4, max_tokens=1200)
        for i in (1, 2):
            assert c.wait_flip(c.flip(f"cell-{i}", "rollout")["id"], 60)["state"] == "done"
        c.wait_flip(c.flip("cell-0", "training")["id"], 120)
        _check_exact(c, prompts, streams)  # re-placed from the store once the cell drops it
    finally:
        c.stop()

"""Scheduler + 3 cells in batch-invariant mode: flipping the owning cell mid-decode moves its
requests with their KV, and every request finishes token-identical to an unmoved run."""

import random

import pytest

from .harness import Cluster, Streamer, reference_tokens

pytestmark = pytest.mark.slow


def _prompts(n, seed=0, lo=40, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, num_cells=3)
    yield c
    c.stop()


def _sample(text: str, name: str) -> float:
    """One sample of a Prometheus exposition (0 when absent)."""
    line = next((ln for ln in text.splitlines() if ln.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def busiest(cluster):
    return max(cluster.cells(), key=lambda c: c["inflight"])["id"]


def test_flip_mid_decode_is_token_identical_and_loses_nothing(cluster):
    prompts = _prompts(4, seed=1)
    streams = [Streamer(cluster.url, p, max_tokens=120, seed=10 + i, token=cluster.agent_token) for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60), cluster.logs()
    cluster.wait(lambda: all(len(s.tokens) >= 5 for s in streams), 60, "tokens flowing")
    victim = busiest(cluster)
    flip = cluster.flip(victim, "training")
    done = cluster.wait_flip(flip["id"], 90)
    for s in streams:
        s.join(120)
    assert done["state"] == "done", (done, cluster.logs())
    assert done["migrated"] >= 1
    assert cluster.cell(victim)["state"] == "training"
    for s, p in zip(streams, prompts):
        assert s.error is None, s.error
        assert s.finish_reason == "length"
        assert len(s.tokens) == 120, "a token was lost or doubled"
        assert s.tokens == reference_tokens(cluster.cfg, s.request_id, p, 120, s.seed), s.request_id
    # every committed KV move's client-visible stall, as the scheduler's token stream saw it
    text = cluster.http.get("/metrics").text
    moved = _sample(text, 'cellflip_migrations_total{outcome="committed",path="kv"}')
    assert moved >= 1 and _sample(text, "cellflip_migration_downtime_seconds_count") == moved
    stall_sum = _sample(text, "cellflip_migration_downtime_seconds_sum")
    assert 0 < stall_sum / moved < 5.0  # a real gap was seen, and it is not a whole request's time
    # and back to rollout
    back = cluster.wait_flip(cluster.flip(victim, "rollout")["id"], 60)
    assert back["state"] == "done"

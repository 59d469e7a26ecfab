"""Scheduler + 3 real cells (gloo, batch-invariant): two jobs are created beside the implicit
one; the planner moves a cell into each, the second while it decodes live rollouts of the
implicit job. Every rollout finishes token-identical to an unmoved run, and none of them ever
ran on (or migrated to) a cell of another job."""

import random

import pytest

from scheduler.store import Store

from .harness import Cluster, Streamer, reference_tokens

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, num_cells=3)
    yield c
    c.stop()


def _jobs(cluster) -> dict:
    return {j["name"]: j for j in cluster.http.get("/v1/jobs").json()["jobs"]}


def _moved_into(cluster, job: str, timeout_s: float = 90) -> str:
    """Wait until the planner's move into `job` is done; the cell moved."""
    def done():
        moves = [m for m in cluster.http.get("/v1/jobs").json()["moves"] if m["to"] == job]
        return moves[0] if moves and moves[0]["state"] in ("done", "undone") else None
    move = cluster.wait(done, timeout_s, f"a cell moved into {job}")
    assert move["state"] == "done", (move, cluster.logs())
    return move["cell"]


def foreign(placements: list[tuple[str, str]], cells_of_other_jobs: set[str]) -> list[tuple[str, str]]:
    """(what, cell) placements on a cell of another job."""
    return [(what, cell) for what, cell in placements if cell in cells_of_other_jobs]


def test_moves_between_jobs_keep_live_rollouts_exact_and_within_their_job(cluster):
    r = cluster.http.post("/v1/jobs", json={"name": "beta", "model": "fleet", "min_cells": 1, "max_cells": 1})
    assert r.status_code == 201, r.text
    beta_cell = _moved_into(cluster, "beta")  # idle: nothing to migrate
    rng = random.Random(3)
    prompts = [[rng.randrange(1024) for _ in range(rng.randrange(40, 100))] for _ in range(4)]
    streams = [Streamer(cluster.url, p, max_tokens=400, seed=20 + i, token=cluster.agent_token)
               for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60), cluster.logs()
    cluster.wait(lambda: all(len(s.tokens) >= 5 for s in streams), 60, "tokens flowing")
    r = cluster.http.post("/v1/jobs", json={"name": "gamma", "model": "fleet", "min_cells": 1, "max_cells": 1})
    assert r.status_code == 201, r.text
    # gamma's minimum asks the planner for a cell; move the busiest default cell there at once (or
    # take the planner's move, when its tick came first), while it decodes live rollouts
    if not [m for m in cluster.http.get("/v1/jobs").json()["moves"] if m["to"] == "gamma"]:
        busiest = max((c for c in cluster.cells() if c["id"] != beta_cell), key=lambda c: c["inflight"])
        assert busiest["inflight"] > 0
        cluster.http.post("/v1/jobs/gamma/cells", json={"cell": busiest["id"]})
    gamma_cell = _moved_into(cluster, "gamma")
    debug = (cluster.http.get("/v1/jobs").json()["moves"], cluster.http.get("/v1/flips").json(),
             [len(s.tokens) for s in streams])
    for s in streams:
        s.join(180)
    for s, p in zip(streams, prompts):
        assert s.error is None, s.error
        assert len(s.tokens) == 400, "a token was lost or doubled"
        assert s.tokens == reference_tokens(cluster.cfg, s.request_id, p, 400, s.seed), s.request_id
    assert _jobs(cluster)["beta"]["cells"] == [beta_cell]
    cluster.stop()
    store = Store(cluster.cfg["scheduler"]["db_path"])
    try:
        migrations = store.execute("SELECT id, src, dst, state FROM migrations").fetchall()
        out_of_gamma = [(m[0], m[2]) for m in migrations if m[1] == gamma_cell and m[3] == "committed"]
        assert out_of_gamma, ("the moved cell's live rollouts did not migrate", migrations, debug)
        placed = [(m[0], m[2]) for m in migrations] + [
            (f"tokens of {sid}", beta_cell) for sid, _ in store.sessions.sampled_by(beta_cell)]
        assert foreign(placed, {beta_cell}) == []
        assert all(dst not in (beta_cell, gamma_cell) for _, dst in out_of_gamma)
        # negative control: the check catches a placement on the other job's cell
        assert foreign([*placed, ("injected", beta_cell)], {beta_cell}) == [("injected", beta_cell)]
    finally:
        store.close()

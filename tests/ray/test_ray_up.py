"""`cellflip up --ray` on a real Ray head (127.0.0.1, 8 CPUs): three one-CPU cell actors in
a SPREAD placement group, the scheduler actor pinned to its store's node. One deployment for
the module; the tests run in order and the last one shuts it down.

- a flip moves live KV between cells that Ray placed, token-exact, nothing lost;
- a cell actor killed with `ray.kill(no_restart=False)` comes back as a new incarnation; the
  scheduler fences the old one and its requests continue elsewhere, token-exact;
- the scheduler actor killed and restarted recovers from its store; the flip in flight
  completes once;
- shutdown leaves no actor, placement group or actor process behind.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import yaml

from cells.localcluster import ROOT, Cluster, Streamer, cluster_config, reference_tokens
from scheduler.contract.tokens import TOKEN_ENV, auth_headers

from .conftest import is_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAMESPACE = "cellflip-test"
UP_TIMEOUT_S = 300


class Deployment(Cluster):
    """The local cluster's REST helpers against what `cellflip up --ray` started, plus the
    test's own Ray driver for killing and inspecting actors."""

    def __init__(self, proc: subprocess.Popen, lines: list[str], url: str, token: str, cfg: dict) -> None:
        import ray

        self.proc, self.lines, self.url, self.token, self.cfg = proc, lines, url, token, cfg
        self.headers = auth_headers(token)
        self.http = httpx.Client(base_url=url, timeout=30.0, headers=self.headers)
        self.ray = ray
        self.pids: set[int] = set()
        """Every actor process seen (none may outlive the shutdown)."""

    def actor(self, name: str):
        return self.ray.get_actor(name, namespace=NAMESPACE)

    def info(self, name: str, timeout_s: float = 60) -> dict:
        out = json.loads(self.ray.get(self.actor(name).info.remote(), timeout=timeout_s))
        self.pids.add(out["pid"])
        return out

    def info_when_up(self, name: str) -> dict | None:
        """`info`, or None while the actor is dead or restarting."""
        try:
            return self.info(name, timeout_s=10)
        except self.ray.exceptions.RayError:
            return None

    def logs(self) -> str:
        return "\n".join(self.lines[-60:])


def _read_lines(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))


@pytest.fixture(scope="module")
def deployment(ray_head, tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("rayup")
    cfg = cluster_config(tmp, scheduler__lease_s=5.0)
    cfg["launcher"] = {"type": "ray", "namespace": NAMESPACE, "ready_timeout_s": UP_TIMEOUT_S}
    (tmp / "cellflip.yaml").write_text(yaml.safe_dump(cfg))
    token = secrets.token_urlsafe(32)
    env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cells.cli", "up", "--ray", ray_head.address, "--no-trainer",
                             "--config", str(tmp / "cellflip.yaml"), "--cells", "3", "--port", "0",
                             "--run-dir", str(tmp / "run")], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    ray.init(address=ray_head.address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    try:
        url = Cluster.wait(lambda: next((ln.split("API ", 1)[1].split()[0] for ln in lines if "up: API http" in ln),
                                        None) or (proc.poll() is not None and "exited"), UP_TIMEOUT_S, "cellflip up")
        assert url != "exited", "\n".join(lines)
        dep = Deployment(proc, lines, url, token, cfg)
        yield dep
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        ray.shutdown()


def _start(dep, n: int, seed: int, max_tokens: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1024) for _ in range(rng.randrange(40, 120))] for _ in range(n)]
    streams = [Streamer(dep.url, p, max_tokens=max_tokens, seed=seed * 100 + i, token=dep.token)
               for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    dep.wait(lambda: all(len(s.tokens) >= 5 for s in streams), 90, "tokens flowing")
    return prompts, streams


def _check_exact(dep, prompts, streams):
    for s in streams:
        s.join(180)
    for s, p in zip(streams, prompts):
        assert s.error is None, (s.error, dep.logs())
        assert len(s.tokens) == s.max_tokens, (s.request_id, len(s.tokens), dep.logs())
        assert s.tokens == reference_tokens(dep.cfg, s.request_id, p, s.max_tokens, s.seed), s.request_id


def _busiest(dep) -> str:
    return max(dep.cells(), key=lambda c: c["inflight"])["id"]


def _back_to_rollout(dep, cell_id: str) -> None:
    if dep.cell(cell_id)["state"] != "rollout":
        assert dep.wait_flip(dep.flip(cell_id, "rollout")["id"], 90)["state"] == "done", dep.logs()


def test_cells_placed_by_ray_flip_with_live_kv_migration_is_token_exact(deployment):
    dep = deployment
    from ray.util import placement_group_table

    pgs = [pg for pg in placement_group_table().values() if pg["name"] == f"{NAMESPACE}-cells"]
    assert len(pgs) == 1 and pgs[0]["strategy"] == "SPREAD" and len(pgs[0]["bundles"]) == 3, pgs
    named = {a["name"] for a in dep.ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
    assert named == {"cellflip-scheduler", "cellflip-cell-0", "cellflip-cell-1", "cellflip-cell-2"}, named
    cells = dep.cells()
    assert sorted(c["id"] for c in cells) == ["cell-0", "cell-1", "cell-2"]
    for c in cells:  # each cell runs in its actor and reports where Ray put it
        info = dep.info(f"cellflip-{c['id']}")
        assert c["incarnation"] == info["incarnation"] and c["state"] == "rollout"
        assert c["capabilities"]["node"].startswith(f"{info['node']}/") and info["node"] == "127.0.0.1"
        assert c["address"].startswith(info["node"] + ":")  # transfers rendezvous at Ray's node address
    status = subprocess.run([sys.executable, "-m", "cells.cli", "status", "--scheduler", dep.url], timeout=60,
                            env={**os.environ, TOKEN_ENV: dep.token}, capture_output=True, text=True)
    assert status.returncode == 0 and status.stdout.split("\n")[0].split()[:3] == ["id", "node", "state"], status
    assert status.stdout.count("127.0.0.1/") == 3, status.stdout  # the same table, with where each cell runs
    prompts, streams = _start(dep, 4, seed=1, max_tokens=200)
    victim = _busiest(dep)
    done = dep.wait_flip(dep.flip(victim, "training")["id"], 90)
    assert done["state"] == "done", (done, dep.logs())
    assert done["migrated"] >= 1, done  # live KV moves, not re-prefills
    _check_exact(dep, prompts, streams)
    _back_to_rollout(dep, victim)


def test_killed_cell_actor_is_restarted_fenced_and_its_requests_continue_elsewhere(deployment):
    dep = deployment
    prompts, streams = _start(dep, 3, seed=2, max_tokens=500)  # still decoding after the kill
    victim = _busiest(dep)
    before = dep.info(f"cellflip-{victim}")
    generation = dep.cell(victim)["generation"]
    dep.ray.kill(dep.actor(f"cellflip-{victim}"), no_restart=False)
    _check_exact(dep, prompts, streams)
    after = dep.wait(lambda: (i := dep.info_when_up(f"cellflip-{victim}")) and i["incarnation"] and i, 180,
                     "the restarted actor registered")
    assert after["pid"] != before["pid"] and after["incarnation"] != before["incarnation"]
    row = dep.wait(lambda: (c := dep.cell(victim))["incarnation"] == after["incarnation"]
                   and c["state"] == "rollout" and c, 60, "the new incarnation in rollout")
    assert row["generation"] > generation  # the old incarnation is fenced, never resumed
    assert any(before["incarnation"] in str(h) or "lease" in str(h) for h in row["history"]), row["history"]


def test_scheduler_actor_killed_recovers_from_its_store_and_the_flip_completes_once(deployment):
    dep = deployment
    prompts, streams = _start(dep, 3, seed=5, max_tokens=500)
    before = dep.info("cellflip-scheduler")
    victim = _busiest(dep)
    flip = dep.flip(victim, "training")
    dep.ray.kill(dep.actor("cellflip-scheduler"), no_restart=False)  # right after the flip was recorded
    for s in streams:
        s.join(30)  # their streams die with the scheduler; the requests must not
    after = dep.wait(lambda: dep.info_when_up("cellflip-scheduler"), 180, "the scheduler actor restarted")
    assert after["pid"] != before["pid"] and after["url"] == dep.url  # same store, same address
    state = dep.wait_flip(flip["id"], 120)
    assert state["state"] in ("done", "rolled_back"), state
    for s, p in zip(streams, prompts):
        assert s.session_id, s.error
        got = dep.wait(lambda s=s: (t := dep.sampled_tokens(s.session_id)) and len(t) >= s.max_tokens and t,
                       180, f"{s.request_id} finished after the restart")
        assert got == reference_tokens(dep.cfg, s.request_id, p, s.max_tokens, s.seed), s.request_id
    flips = dep.http.get("/v1/flips").json()
    flips = flips["flips"] if isinstance(flips, dict) else flips
    assert sum(f["id"] == flip["id"] for f in flips) == 1  # never runs twice


def test_failed_start_up_leaves_nothing_behind(deployment, ray_head, tmp_path):
    """Three cells that must each have a node of their own, on a one-node cluster: start-up
    gives up after `ready_timeout_s` and takes down what it had started."""
    from ray.util import placement_group_table

    cfg = cluster_config(tmp_path)
    cfg["launcher"] = {"type": "ray", "namespace": "cellflip-test-nofit", "placement": "STRICT_SPREAD",
                       "ready_timeout_s": 30}
    (tmp_path / "nofit.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "cells.cli", "up", "--ray", ray_head.address, "--no-trainer",
                          "--config", str(tmp_path / "nofit.yaml"), "--cells", "3", "--port", "0",
                          "--run-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=180, env={**os.environ, TOKEN_ENV: deployment.token, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and "placement group" in run.stdout, run.stdout[-3000:]
    named = [a for a in deployment.ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "cellflip-test-nofit"]
    assert named == [], named
    assert not [pg for pg in placement_group_table().values()
                if pg["name"] == "cellflip-test-nofit-cells" and pg["state"] != "REMOVED"]


def test_shutdown_leaves_no_actor_placement_group_or_process(deployment, ray_head):
    dep = deployment
    for name in ("cellflip-scheduler", "cellflip-cell-0", "cellflip-cell-1", "cellflip-cell-2"):
        dep.info(name)
    dep.proc.send_signal(signal.SIGINT)
    assert dep.proc.wait(timeout=90) == 0, dep.logs()
    from ray.util import placement_group_table

    named = [a for a in dep.ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    assert named == [], named
    live = [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
    assert live == [], live
    dep.wait(lambda: not any(is_alive(pid) for pid in dep.pids), 30, "actor processes gone")
    assert not (dep.pids & ray_head.processes())  # the head itself is the fixture's to stop

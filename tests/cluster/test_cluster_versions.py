"""Weight versions on real cells: a trainer-side version host broadcasts while cells decode;
tokens carry the version they were sampled under; the log-prob service gives every sampled
token its exact old log-prob (bitwise the scoring primitive with that version's weights);
superseded versions retire only once scored; a cell entering rollout later catches up."""


import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.engine.records import SamplingParams
from cells.transport.versions_host import VersionHost
from scheduler.contract.config import parse_config

from .harness import Cluster
from .test_cluster_faults import _start

pytestmark = pytest.mark.slow


def _versions_of(cfg, n):
    """Version 0 (what cells start with) and n perturbed successors."""
    ecfg = parse_config(cfg).cells.engine
    w = init_weights(resolve_spec(ecfg.model), ecfg.model.seed)
    out = {0: w}
    g = torch.Generator().manual_seed(1234)
    for v in range(1, n + 1):
        w = {k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in w.items()}
        out[v] = w
    return out


def _publish(c, host, v, weights):
    host.put(v, weights[v])
    a = host.address
    c.http.put("/v1/trainer/version-host", json={"host": a.host, "port": a.port}).raise_for_status()
    r = c.http.post("/v1/versions", json={"version": v, "source": {"host": a.host, "port": a.port}})
    assert r.status_code == 201, r.text
    receivers = r.json()["receivers"]
    res = host.broadcast(v, receivers)
    assert sorted(res.delivered) == sorted(receivers) and not res.failed, res
    c.wait(lambda: _version(c, v)["state"] == "active", 60, f"version {v} active")
    return receivers


def _version(c, v):
    return next(x for x in c.http.get("/v1/versions").json()["versions"] if x["version"] == v)


def _all_scored(c, sid):
    s = c.session(sid)
    return all(p == "exact" for p, m in zip(s["provenance"], s["loss_mask"]) if m)


def test_broadcast_while_decoding_then_every_token_exactly_scored(tmp_path):
    c = Cluster(tmp_path, num_cells=2)
    host = VersionHost(bucket_bytes=4 << 20)
    host.start()
    try:
        weights = _versions_of(c.cfg, 2)
        prompts, streams = _start(c, 2, seed=11, max_tokens=1200)  # version 2 lands ~300 tokens after its publish starts here: room for a loaded machine
        assert sorted(_publish(c, host, 1, weights)) == ["cell-0", "cell-1"]
        c.wait(lambda: all(len(s.tokens) >= 60 for s in streams), 120, "decoding under version 1")
        _publish(c, host, 2, weights)
        for s in streams:
            s.join(180)
            assert s.error is None and len(s.tokens) == 1200, (s.error, c.logs())
        ecfg = parse_config(c.cfg).cells.engine
        engines = {v: EmbeddedEngine(ecfg, weights=w, version=v) for v, w in weights.items()}
        for s in streams:
            c.wait(lambda s=s: _all_scored(c, s.session_id), 120, "every token scored")
            sess = c.session(s.session_id)
            sampled = [i for i, m in enumerate(sess["loss_mask"]) if m]
            vs = [sess["versions"][i] for i in sampled]
            assert vs == sorted(vs) and {0, 1, 2} <= set(vs), vs  # tokens carry their version
            ids = sess["token_ids"]
            for v in (0, 1, 2):
                idx = [i for i in sampled if sess["versions"][i] == v]
                ref = engines[v].score(ids[: idx[-1] + 1])  # the scoring primitive, directly
                assert [sess["old_logprobs"][i] for i in idx] == [float(ref[i - 1]) for i in idx], v
            # before any update, behaviour and old policy are the same numbers (batch-invariant)
            v0 = [i for i in sampled if sess["versions"][i] == 0]
            assert [sess["logprobs"][i] for i in v0] == [sess["old_logprobs"][i] for i in v0]
        c.wait(lambda: _version(c, 1)["state"] == "retired", 60, "version 1 retired once scored")
        v1 = _version(c, 1)
        assert v1["tokens_unscored"] == 0 and v1["tokens_scored"] == v1["tokens_generated"] > 0
        r = c.http.delete("/v1/versions/2")
        assert r.status_code == 409, r.text  # the active version is never retired
    finally:
        host.close()
        c.stop()


def test_recompute_policy_and_late_joiner_catch_up(tmp_path):
    c = Cluster(tmp_path, num_cells=2, scheduler__min_rollout_cells=1, versions__inflight_policy="recompute")
    host = VersionHost(bucket_bytes=4 << 20)
    host.start()
    try:
        weights = _versions_of(c.cfg, 1)
        assert c.wait_flip(c.flip("cell-1", "training")["id"], 60)["state"] == "done"
        prompts, streams = _start(c, 1, seed=12, max_tokens=300)
        c.wait(lambda: len(streams[0].tokens) >= 30, 60, "decoding")
        assert _publish(c, host, 1, weights) == ["cell-0"]
        flip = c.wait_flip(c.flip("cell-1", "rollout")["id"], 90)  # loading: fetches version 1 first
        assert flip["state"] == "done", flip
        assert c.cell("cell-1")["version"] == 1 or _version(c, 1)["cells"] == ["cell-0", "cell-1"]
        s = streams[0]
        s.join(180)
        assert s.error is None and len(s.tokens) == 300
        sess = c.session(s.session_id)
        gen_versions = [v for v, m in zip(sess["versions"], sess["loss_mask"]) if m]
        k = gen_versions.index(1)
        assert set(gen_versions[:k]) == {0} and set(gen_versions[k:]) == {1}
        # recompute: from the switch on, exactly what a re-prefill under version 1 samples
        eng = EmbeddedEngine(parse_config(c.cfg).cells.engine, weights=weights[1], version=1)
        p = prompts[0]
        eng.add_request(s.request_id, p + s.tokens[:k], SamplingParams(max_tokens=300, seed=s.seed), prompt_len=len(p))
        rest = []
        while eng.has_work():
            rest += [e.record.token_id for e in eng.step()]
        assert s.tokens[k:] == rest
    finally:
        host.close()
        c.stop()


def test_export_weights_writes_what_a_cell_serves_bitwise(tmp_path):
    """`cellflip export-weights 0 DIR` on a live fleet: the cell holding version 0 writes it
    below its export root, and an engine loading that directory gives bitwise the log-probs
    the cell reported for the tokens it sampled (batch-invariant mode); a directory that
    exists is refused, never overwritten."""
    from cells.cli import main as cli
    from cells.localcluster import Streamer, cluster_config

    cfg = cluster_config(tmp_path)
    cfg["cells"]["export_root"] = str(tmp_path / "exports")
    c = Cluster(tmp_path, num_cells=1, cfg=cfg)
    try:
        stream = Streamer(c.url, [5, 6, 7, 8], max_tokens=12, seed=3, token=c.agent_token)
        stream.start()
        stream.join(120)
        assert stream.finish_reason == "length", stream.error
        s = c.session(stream.session_id)
        token_file = tmp_path / "trainer.token"
        token_file.write_text(c.tokens["trainer"])
        args = ["export-weights", "0", "fleet/v0", "--scheduler", c.url, "--token-file", str(token_file),
                "--timeout", "120"]
        assert cli(args) == 0
        out = tmp_path / "exports" / "fleet" / "v0"
        ecfg = parse_config({"cells": {"engine": {**cfg["cells"]["engine"],
                                                  "model": {"preset": None, "path": str(out)}}}}).cells.engine
        scored = EmbeddedEngine(ecfg).score(s["token_ids"]).tolist()
        sampled = [(lp, scored[i - 1]) for i, (m, lp) in enumerate(zip(s["loss_mask"], s["logprobs"])) if m]
        assert len(sampled) == 12 and all(a == b for a, b in sampled), sampled
        other = parse_config({"cells": {"engine": {**cfg["cells"]["engine"], "model": {
            **cfg["cells"]["engine"]["model"], "seed": 99}}}}).cells.engine
        rescored = EmbeddedEngine(other).score(s["token_ids"]).tolist()
        assert any(lp != rescored[i - 1] for i, (m, lp) in enumerate(zip(s["loss_mask"], s["logprobs"])) if m)
        with pytest.raises(SystemExit, match="never overwrites"):
            cli(args)
    finally:
        c.stop()

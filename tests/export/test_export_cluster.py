"""`cellflip export --weights` then `cellflip replay` on a live fleet: the exporter (a reader
token for the rows, a trainer token where cells must write the weights) puts the version the
rows name beside them, and the directory alone replays the sampled tokens bit for bit."""

from __future__ import annotations

import json

import pytest

from cells.cli import main as cli
from cells.localcluster import Cluster, Streamer, cluster_config

pytestmark = pytest.mark.slow


def test_export_with_weights_then_replay_on_a_live_fleet(tmp_path, capsys):
    cfg = cluster_config(tmp_path)
    cfg["cells"]["export_root"] = str(tmp_path / "exports")
    c = Cluster(tmp_path, num_cells=1, cfg=cfg)
    try:
        stream = Streamer(c.url, [5, 6, 7, 8], max_tokens=12, seed=3, token=c.agent_token)
        stream.start()
        stream.join(120)
        assert stream.finish_reason == "length", stream.error
        r = c.http.post(f"/v1/sessions/{stream.session_id}/finish", json={"reward": 1.0, "group_id": "g"})
        assert r.status_code == 200, r.text
        reader, trainer = tmp_path / "reader.token", tmp_path / "trainer.token"
        reader.write_text(c.tokens["reader"])
        trainer.write_text(c.tokens["trainer"])
        out = tmp_path / "export"
        assert cli(["export", "--out", str(out), "--format", "jsonl", "--scheduler", c.url, "--token-file",
                    str(reader)]) == 0
        # the reader token cannot have a cell write weights: the answer is recorded, nothing copied
        assert cli(["export", "--out", str(out), "--format", "jsonl", "--scheduler", c.url, "--token-file",
                    str(reader), "--weights"]) == 0
        w = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weights"]["0"]
        assert w["state"] in ("named", "unavailable") and w["asked"]["status"] == 403
        assert cli(["export", "--out", str(out), "--format", "jsonl", "--scheduler", c.url, "--token-file",
                    str(trainer), "--weights"]) == 0
    finally:
        c.stop()
    m = json.loads((out / "manifest.json").read_text())
    assert m["rows"] == 1 and m["versions"] == [0] and m["weights"]["0"]["state"] == "copied"
    capsys.readouterr()
    assert cli(["replay", str(out)]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["replay_exact_frac"] == 1.0 and rep["versions"]["0"]["kept_tokens"] == 12

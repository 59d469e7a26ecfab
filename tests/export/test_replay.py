"""`cellflip replay` from an export directory alone: re-scored behaviour and exact old
log-probs match bit for bit at their version, the wrong version does not; `--serve` samples
every turn again token-identically, and a changed token is caught."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.engine.records import SamplingParams
from cells.export.replay import replay
from cells.export.writer import ExportDir
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

MODEL = ModelConfig(preset="tiny", vocab_size=256, hidden_size=64, num_layers=2, head_dim=16, intermediate_size=128,
                    output_id_ranges=[(0, 200)], seed=0)


def _sample(engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    engine.add_request(rid, prompt, params)
    ids, lps = [], []
    while engine.has_work():
        for ev in engine.step():
            ids.append(ev.record.token_id)
            lps.append(ev.record.logprob)
    return ids, lps


def _row(sid: str, seq: int, ids: list[int], mask: list[int], lps: list, versions: list, olds: list,
         turns: list[dict]) -> dict:
    return {"session_id": sid, "finish_seq": seq, "job": "t", "group_id": "g", "parent_id": None, "branch": 0,
            "reward": 1.0, "finish_reason": "length", "created_at": 0.0, "finished_at": 1.0, "tainted": False,
            "segment_starts": [0], "token_ids": ids, "loss_mask": mask, "logprob": lps, "version": versions,
            "old_logprob": olds, "old_provenance": [int(m) for m in mask], "cell_idx": [0 if m else -1 for m in mask],
            "truncated": [0] * len(ids), "cells": ["c1"], "turns": turns, "migrations": [], "messages": None,
            "training": None}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    spec = resolve_spec(MODEL)
    cfg = EmbeddedEngineConfig(model=MODEL, batch_invariant=True, num_blocks=128, block_size=8)
    rows = []
    for v in (1, 2):
        w = init_weights(spec, seed=10 + v)
        save_checkpoint(root / "weights" / f"v{v}", spec, w, version=v)
        engine = EmbeddedEngine(cfg, spec=spec, weights=w, version=v)
        g = torch.Generator().manual_seed(v)
        for k in range(2):
            sid = f"t-v{v}-s{k}"
            ids, mask, lps, olds, vers, turns = [], [], [], [], [], []
            for turn in range(2):  # a second turn continues the context
                prompt = torch.randint(0, 200, (5,), generator=g).tolist()
                ids += prompt
                mask += [0] * 5
                lps += [None] * 5
                vers += [None] * 5
                olds += [None] * 5
                params = SamplingParams(temperature=1.0, max_tokens=6, seed=100 + k)
                rid = f"{sid}-r{turn}"
                out, out_lps = _sample(engine, rid, list(ids), params)
                base = len(ids)
                turns.append({"request_id": rid, "prompt_start": 0, "base": base, "num_generated": len(out),
                              "cell": "c1", "epoch": 0, "state": "finished", "reason": "length",
                              "params": params.model_dump(), "created_at": 0.0, "updated_at": 0.0})
                ids += out
                mask += [1] * len(out)
                lps += out_lps
                vers += [v] * len(out)
                old = engine.score(ids, version=v).tolist()[base - 1:]
                olds += old
            rows.append(_row(sid, len(rows) + 1, ids, mask, lps, vers, olds, turns))
    d = ExportDir(root, "parquet", {})
    d.write_part(0, rows)
    return root


def test_replay_matches_bitwise_and_the_wrong_version_does_not(export_dir):
    r = replay(export_dir, tile=4)
    assert r["sessions"] == 4 and r["replay_exact_frac"] == 1.0, r
    for v in ("1", "2"):
        d = r["versions"][v]
        assert d["replay_exact_frac"] == 1.0 and d["old_tokens"] == d["kept_tokens"] == 24
        assert d["control_match_frac"] == 0.0  # scored with the other version's weights
    assert r["control_match_frac"] == 0.0


def test_replay_serve_and_a_changed_token_is_caught(export_dir, tmp_path):
    r = replay(export_dir, tile=4, serve="direct")
    assert r["replay_serve_sessions"] == 4 and r["replay_serve_identical_frac"] == 1.0
    # negative control: one recorded completion token changed
    import shutil

    import pyarrow.parquet as pq

    bad = tmp_path / "bad"
    shutil.copytree(export_dir, bad)
    rows = pq.read_table(bad / "data").to_pylist()
    i = rows[0]["turns"][0]["base"]
    rows[0]["token_ids"][i] = (rows[0]["token_ids"][i] + 1) % 200
    for f in (bad / "data").iterdir():
        f.unlink()
    (bad / "manifest.json").unlink()
    ExportDir(bad, "jsonl", {}).write_part(0, [{**r, "training": None} for r in rows])
    out = replay(bad, tile=4, serve="direct")
    assert out["replay_serve_identical_frac"] == 0.75 and out["replay_exact_frac"] < 1.0


def test_cli_replay_in_a_fresh_process(export_dir):
    p = subprocess.run([sys.executable, "-m", "cells.cli", "replay", str(export_dir)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["replay_exact_frac"] == 1.0


def test_weights_are_copied_beside_the_rows_or_named(export_dir, tmp_path):
    from types import SimpleNamespace

    from cells.export.weights import collect

    d = ExportDir(tmp_path / "w", "jsonl", {})
    d.note("versions", [1, 2, 3])
    src = SimpleNamespace(versions=lambda: [{"version": 3, "state": "retired", "source": {"kind": "cell"}}])
    found = collect(src, d, [str(export_dir / "weights")], ask_cells=False)
    assert found["1"]["state"] == found["2"]["state"] == "copied"
    assert (tmp_path / "w" / "weights" / "v2" / "config.json").is_file()
    assert found["3"] == {"state": "named", "version_state": "retired", "source": {"kind": "cell"}}
    assert collect(src, d, [], ask_cells=False)["1"]["state"] == "present"


def test_turns_a_forward_cannot_rebuild_are_set_apart():
    from cells.export.turns import apart

    row = {"version": [None, 1, 1, None, 2, 2], "migrations": []}
    assert apart(row, 0, 4, {2})  # its context was sampled under version 1 (an in-flight KV)
    assert not apart(row, 0, 1, {1}) and not apart({**row, "version": [None, 2, 2, None, 2, 2]}, 0, 4, {2})
    assert apart(row, 0, 1, {1, 2})  # its tokens span versions
    assert apart({**row, "migrations": [{"path": "reprefill", "state": "committed"}]}, 0, 1, {1})


def _rewritten(export_dir, dst, change) -> None:
    """A copy of the export whose rows went through `change` (the weights kept)."""
    import shutil

    import pyarrow.parquet as pq

    shutil.copytree(export_dir, dst)
    rows = [change(r) for r in pq.read_table(dst / "data").to_pylist()]
    for f in (dst / "data").iterdir():
        f.unlink()
    (dst / "manifest.json").unlink()
    ExportDir(dst, "jsonl", {}).write_part(0, [{**r, "training": None} for r in rows if r is not None])


@pytest.mark.slow
def test_replay_serve_through_a_gateway_and_a_wrong_seed_is_not_identical(export_dir, tmp_path):
    r = replay(export_dir, tile=4, serve="gateway")
    assert r["replay_serve_path"] == "gateway" and r["replay_serve_sessions"] == 4
    assert r["replay_serve_identical_frac"] == 1.0 and r["replay_serve_no_weights"] == 0

    def reseeded(row):  # version 1's sessions only (one throwaway fleet), each turn under another seed
        if row["version"][row["turns"][0]["base"]] != 1:
            return None
        for t in row["turns"]:
            t["params"] = json.dumps({**json.loads(t["params"]), "seed": json.loads(t["params"])["seed"] + 1})
        return row

    _rewritten(export_dir, tmp_path / "reseeded", reseeded)
    bad = replay(tmp_path / "reseeded", tile=4, serve="gateway")
    assert bad["replay_serve_sessions"] == 2 and bad["replay_serve_identical_frac"] == 0.0

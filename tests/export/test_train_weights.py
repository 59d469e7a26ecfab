"""The per-token correction weights training used, written back with the outcome (bounded,
validated at the route) and exported as `train_weight`, aligned with `token_ids`."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from sched_fakes import Harness
from storekit import add_session

from cells.export.run import run_export
from cells.export.source import ExportSource
from cells.export.writer import ExportDir, read_rows
from cells.rl.used_weights import encode
from cells.trainer import outcomes
from scheduler.contract.config import CellflipConfig

W = np.array([0.5, 1.25, 0.0], dtype=np.float32)


@pytest.fixture
def h(tmp_path):
    os.environ.pop("CELLFLIP_READER_TOKEN", None)
    h = Harness(str(tmp_path / "s.sqlite"))
    st = h.ctl.store
    # two turns: sampled tokens at 2, 3 (turn 0) and 6 (turn 1)
    h.client.portal.call(lambda: add_session(st, "w-e0", turns=[([1, 2], [5, 6], [-1.0, -2.0], 1),
                                                                 ([7, 8], [9], [-0.5], 1)], reward=1.0))
    yield h
    h.close()


def _post(h, weights) -> object:
    body = {"outcomes": {"w-e0": {"status": "trained", "weights": weights}}}
    return h.client.post("/v1/trajectories/outcomes", json=body, headers=h.auth("trainer"))


def _row(h) -> dict:
    return h.client.get("/v1/export/trajectories", headers=h.auth("reader")).json()["items"][0]


def _source(h) -> ExportSource:
    src = ExportSource.__new__(ExportSource)
    src.url, src.http = "testclient", h.client
    h.client.headers.update(h.auth("reader"))
    return src


def _aligned(row: dict, weights: np.ndarray) -> bool:
    """The reader's check: the loss-mask tokens carry the weights in order, the others none."""
    got = row["train_weight"]
    if got is None:
        return False
    sampled = [w for w, m in zip(got, row["loss_mask"]) if m]
    return all(w is None for w, m in zip(got, row["loss_mask"]) if not m) and sampled == weights.tolist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_weights_are_exported_aligned_with_the_tokens(h, tmp_path, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    assert _post(h, encode(W)).json() == {"recorded": 1, "unknown": 0}
    run_export(_source(h), ExportDir(tmp_path / "x", fmt, {}))
    [row] = read_rows(tmp_path / "x")
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 0, 1] and row["train_weight_note"] is None
    assert row["train_weight"] == [None, None, 0.5, 1.25, None, None, 0.0] and _aligned(row, W)
    # negative controls: weights of another session (or shifted by one token) fail the check
    assert not _aligned(row, W[::-1]) and not _aligned(dict(row, loss_mask=[0, 1, 1, 0, 0, 0, 1]), W)


def test_a_recording_that_does_not_fit_the_row_is_noted_never_misaligned(h, tmp_path):
    from cells.export.table import flat_row

    _post(h, encode(W[:2]))  # two weights for three loss-mask tokens
    row = flat_row(_row(h))
    assert row["train_weight"] is None and row["train_weight_note"] == "mismatch: 2 weights for 3 loss-mask tokens"


@pytest.mark.parametrize("bad", ["not base64!", encode(W)[:-4] + "AAA=", 17])
def test_the_route_refuses_malformed_weights_and_records_nothing(h, bad):
    r = _post(h, bad)
    assert r.status_code == 422 and "weights" in r.json()["detail"], r.text
    assert _row(h)["training"] is None  # nothing of the write-back was kept


def test_the_trainer_sends_the_weights_bounded(monkeypatch):
    posted = []
    client = SimpleNamespace(_call=lambda m, p, json: posted.append(json))
    from cells.trainer.trainer import resolved_objective

    coord = SimpleNamespace(objective=resolved_objective(CellflipConfig()), used_weights={"s0": encode(W[:2])})
    t = SimpleNamespace(client=client, version=5, rl_step=4, cfg=CellflipConfig(), coordinator=coord)
    batch = [{"id": f"s{i}", "group_id": "g", "reward": float(i), "loss_mask": [0, 1, 1], "versions": [None, 3, 4],
              "token_ids": [1, 2, 3], "logprobs": [None, -1.0, -1.0], "old_logprobs": [None, -1.0, -1.0],
              "provenance": [None, "exact", "exact"], "segment_starts": [0]} for i in range(2)]
    outcomes.trained(t, batch, {}, 4, None)
    o = posted[-1]["outcomes"]
    assert o["s0"]["weights"] == encode(W[:2]) and "weights" not in o["s1"]
    assert o["s1"]["weights_missing"] == 2  # no rank sent s1's: said so, not silently absent
    monkeypatch.setattr(outcomes, "MAX_WEIGHT_TOKENS", 1)
    outcomes.trained(t, batch, {}, 4, None)
    assert "weights" not in posted[-1]["outcomes"]["s0"] and posted[-1]["outcomes"]["s0"]["weights_omitted"] == 2
    # the POST bodies stay under the byte bound: one session alone when it is bigger
    monkeypatch.setattr(outcomes, "OUTCOME_POST_BYTES", 200)
    big = {f"s{i}": {"status": "trained", "weights": "A" * 120} for i in range(3)}
    parts = outcomes.chunks(big)
    assert [list(p) for p in parts] == [["s0"], ["s1"], ["s2"]]
    assert all(len(json.dumps(p)) < 400 for p in parts) and {k for p in parts for k in p} == set(big)

"""The export's read path (no side effects, least privilege), the exporter's directory
(parts, manifest, checksums, exactly once across a restart) and its formats."""

from __future__ import annotations

import json
import os

import pytest
from sched_fakes import Harness
from storekit import add_session, random_session

from cells.export.run import run_export
from cells.export.source import ExportError, ExportSource
from cells.export.writer import ExportDir, read_rows, verify


@pytest.fixture
def h(tmp_path):
    os.environ.pop("CELLFLIP_READER_TOKEN", None)
    h = Harness(str(tmp_path / "s.sqlite"))
    yield h
    h.close()


def _store(h):
    return h.ctl.store


def _seed(h, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        h.client.portal.call(lambda i=i: random_session(_store(h), f"run-e{i}", seed=i))


def _source(h, scope: str = "reader") -> ExportSource:
    src = ExportSource.__new__(ExportSource)
    src.url, src.http = "testclient", h.client
    h.client.headers.update(h.auth(scope))
    return src


def test_read_path_has_no_side_effects_and_reader_is_least_privilege(h):
    _seed(h, 3)
    reader = h.auth("reader")
    before = h.client.get("/v1/versions").json()["staleness"]
    page = h.client.get("/v1/export/trajectories", params={"after": 0, "limit": 2}, headers=reader).json()
    assert [r["session_id"] for r in page["items"]] == ["run-e0", "run-e1"] and page["next"] == 2
    again = h.client.get("/v1/export/trajectories", params={"after": 0}, headers=reader).json()
    assert len(again["items"]) == 3  # read twice: the same rows, nothing consumed
    assert h.client.get("/v1/versions").json()["staleness"] == before
    # the negative control: the trainer's own read moves its counters
    h.client.get("/v1/trajectories", params={"cursor": 0, "limit": 8})
    assert h.client.get("/v1/versions").json()["staleness"] != before
    for method, path in [("GET", "/v1/trajectories"), ("POST", "/v1/flips"), ("GET", "/v1/cells"),
                         ("POST", "/v1/trajectories/outcomes"), ("POST", "/v1/versions/1/exports")]:
        assert h.client.request(method, path, headers=reader, json={}).status_code == 403, path
    assert h.client.get("/v1/export/stream", headers=h.auth("agent")).status_code == 403


def test_row_columns_and_stream(h):
    st = _store(h)
    h.client.portal.call(lambda: add_session(st, "job1-e0.b1", turns=[([1, 2, 3], [7, 8], [-0.5, -0.25], 3)],
                                             reward=1.0, moved_to="c2"))
    h.client.portal.call(lambda: random_session(st, "job2-e1", seed=1))
    lines = [json.loads(x) for x in h.client.get("/v1/export/stream", headers=h.auth("reader")).text.splitlines()]
    assert lines[-1] == {"next": 2} and len(lines) == 3
    r = lines[0]
    assert (r["session_id"], r["job"], r["parent_id"], r["branch"], r["reward"]) == ("job1-e0.b1", "job1", "job1-e0",
                                                                                    1, 1.0)
    assert r["token_ids"] == [1, 2, 3, 7, 8] and r["loss_mask"] == [0, 0, 0, 1, 1]
    assert r["logprob"] == [None, None, None, -0.5, -0.25] and r["old_logprob"] == r["logprob"]
    assert r["old_provenance"] == [0, 0, 0, 1, 1] and r["version"] == [None, None, None, 3, 3]
    assert r["cells"] == ["c1"] and r["cell_idx"] == [-1, -1, -1, 0, 0]
    assert r["turns"][0]["base"] == 3 and r["turns"][0]["num_generated"] == 2 and r["finish_reason"] == "stop"
    assert r["migrations"][0]["path"] == "reprefill" and r["migrations"][0]["dst"] == "c2"
    only = h.client.get("/v1/export/stream", params={"job": "job2"}, headers=h.auth("reader")).text.splitlines()
    assert [json.loads(x).get("session_id") for x in only] == ["job2-e1", None]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_dir_exactly_once_across_a_restart(h, tmp_path, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    _seed(h, 5)
    out = tmp_path / "out"
    src = _source(h)
    stats = run_export(src, ExportDir(out, fmt, {}), part_rows=2)
    assert stats.rows == 5 and len(stats.parts) == 3
    # a crash after a part's rename, before the manifest listed it; and a half-written part
    _seed(h, 3, start=5)
    d = ExportDir(out, fmt, {})
    run_export(src, d, part_rows=2)
    m = json.loads((out / "manifest.json").read_text())
    last = m["parts"].pop()
    m["rows"] -= last["rows"]
    m["tokens"] -= last["tokens"]
    m["cursor"] = m["parts"][-1]["last_seq"]
    (out / "manifest.json").write_text(json.dumps(m))
    (out / "data" / f".part-x.{fmt}.tmp").write_bytes(b"half")
    _seed(h, 2, start=8)
    run_export(src, ExportDir(out, fmt, {}), part_rows=2)
    rows = read_rows(out)
    ids = [r["session_id"] for r in rows]
    assert ids == [f"run-e{i}" for i in range(10)]  # each once, in finish order
    m = json.loads((out / "manifest.json").read_text())
    assert m["rows"] == 10 and m["cursor"] == 10 and m["schema_version"] == 1 and m["format"] == fmt
    assert m["tokens"] == sum(len(r["token_ids"]) for r in rows) and m["float32_inexact"] == 0
    assert not list((out / "data").glob(".*.tmp")) and verify(out) == []
    # negative control: a changed part fails its checksum
    part = out / m["parts"][0]["file"]
    part.write_bytes(part.read_bytes()[:-1] + b"\x00")
    assert verify(out) == [f"data/{part.name}: checksum differs from the manifest"]


def test_parquet_loads_and_reward_by_version(h, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    st = _store(h)
    for i, (v, rew) in enumerate([(1, 0.0), (1, 1.0), (2, 1.0)]):
        h.client.portal.call(lambda i=i, v=v, rew=rew: add_session(st, f"r-e{i}", turns=[([1, 2], [5, 6], [-1.0, -2.0],
                                                                                          v)], reward=rew))
    out = tmp_path / "pq"
    run_export(_source(h), ExportDir(out, "parquet", {}))
    t = pq.read_table(str(out / "data"))  # the parts as one dataset
    assert t.num_rows == 3 and t.schema.field("logprob").type == pa.list_(pa.float32())
    # the README's example: mean reward by the version that sampled each session's first token
    first = pa.array([next(v for v in vs if v is not None) for vs in t["version"].to_pylist()])
    by = pa.table({"version": first, "reward": t["reward"]}).group_by("version").aggregate([("reward", "mean")])
    assert dict(zip(by["version"].to_pylist(), by["reward_mean"].to_pylist())) == {1: 0.5, 2: 1.0}


def test_parquet_loads_in_pandas(h, tmp_path):
    pytest.importorskip("pyarrow")
    pd = pytest.importorskip("pandas")  # not in the dev extra: checked where it is installed
    _seed(h, 2)
    run_export(_source(h), ExportDir(tmp_path / "pq", "parquet", {}))
    df = pd.read_parquet(tmp_path / "pq" / "data")
    assert list(df["session_id"]) == ["run-e0", "run-e1"]


def test_refusals_lose_nothing(h, tmp_path):
    _seed(h, 1)
    src = _source(h, scope="agent")
    d = ExportDir(tmp_path / "o", "jsonl", {})
    with pytest.raises(ExportError, match="403"):
        run_export(src, d)
    assert d.cursor == 0 and d.manifest["rows"] == 0
    with pytest.raises(ValueError, match="jsonl export"):
        ExportDir(tmp_path / "o", "parquet", {})


def test_packed_rows_are_the_same_rows(h):
    from cells.export.table import flat_row

    _seed(h, 3)
    get = lambda packed: [json.loads(x) for x in h.client.get(  # noqa: E731
        "/v1/export/stream", params={"packed": packed}, headers=h.auth("reader")).text.splitlines()[:-1]]
    plain, packed = get("false"), get("true")
    assert "packed" in packed[0] and "token_ids" not in packed[0]
    assert [flat_row(r) for r in packed] == [flat_row(r) for r in plain]
    packed[0]["packed"]["logprob"] = plain[1]["token_ids"] and packed[1]["packed"]["logprob"]  # another row's
    assert flat_row(packed[0]) != flat_row(plain[0])


def test_follow_writes_sessions_as_they_finish_until_stopped(h, tmp_path):
    import threading
    import time

    _seed(h, 2)
    d = ExportDir(tmp_path / "f", "jsonl", {})
    stop = threading.Event()
    t = threading.Thread(target=run_export, args=(_source(h), d), kwargs={"follow": True, "poll_s": 0.05, "stop": stop})
    t.start()
    try:
        deadline = time.monotonic() + 20
        while d.manifest["rows"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _seed(h, 2, start=2)
        while d.manifest["rows"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(timeout=20)
    assert not t.is_alive()
    assert [r["session_id"] for r in read_rows(tmp_path / "f")] == [f"run-e{i}" for i in range(4)]
    st = h.client.get("/v1/export/status", headers=h.auth("reader")).json()
    assert st["acks"] == {d.manifest["exporter"]: 4}  # acknowledged as written


def test_cli_refuses_a_directory_of_another_format(tmp_path):
    from cells.cli import main

    ExportDir(tmp_path / "o", "jsonl", {})
    with pytest.raises(SystemExit, match="holds a jsonl export"):
        main(["export", "--out", str(tmp_path / "o"), "--format", "parquet", "--scheduler", "http://127.0.0.1:9"])

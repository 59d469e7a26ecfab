"""REST API edges: auth on every route, error codes, body limits, metrics names."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from sched_fakes import FakeCell, make_config, open_harness

from scheduler.api.app import create_app
from scheduler.api.limits import BodySizeLimit
from scheduler.contract.config import ConfigError
from tests.conftest import AUTH


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _paths(app) -> list[tuple[str, str]]:
    """Every (method, path) the app serves: the OpenAPI operations plus plain routes (docs)."""
    out = set()
    for path, ops in app.openapi()["paths"].items():
        for method in ops:
            out.add((method.upper(), path.replace("{", "").replace("}", "")))
    for r in app.routes:
        if hasattr(r, "path") and hasattr(r, "methods"):
            out.update((m, r.path.replace("{", "").replace("}", "")) for m in r.methods if m != "HEAD")
    return sorted(out)


PUBLIC_PATHS = ("/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def test_every_route_but_healthz_and_the_docs_needs_a_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    app = create_app(make_config(auth_token_file=str(token)), db_path=str(tmp_path / "a.sqlite"), tick_interval_s=None)
    with TestClient(app) as client:
        routes = _paths(app)
        assert len(routes) >= 20 and ("GET", "/docs") in routes and ("GET", "/metrics") in routes
        for method, path in routes:
            r = client.request(method, path, json={})
            if path in PUBLIC_PATHS:
                assert r.status_code == 200, path
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
            wrong = client.request(method, path, json={}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == (200 if path in PUBLIC_PATHS else 401)
        ok = client.get("/v1/cells", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        cell = FakeCell(client, "c", headers={"Authorization": "Bearer s3cret"})
        cell.register(), cell.sync()


def test_unreadable_or_empty_token_file_stops_startup(tmp_path):
    with pytest.raises(ConfigError):
        create_app(make_config(auth_token_file=str(tmp_path / "missing")), db_path=str(tmp_path / "a.sqlite"))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError):
        create_app(make_config(auth_token_file=str(tmp_path / "empty")), db_path=str(tmp_path / "a.sqlite"))


def test_not_found_and_validation_errors_are_json(harness):
    c = harness.client
    for path in ("/v1/cells/x", "/v1/flips/x", "/v1/sessions/x"):
        r = c.get(path)
        assert r.status_code == 404 and r.json()["reason"] == "not_found"
    assert c.delete("/v1/versions/3").status_code == 404
    assert c.delete("/v1/versions/abc").status_code == 422
    bad = [
        ("POST", "/v1/flips", {"to": "sideways"}),
        ("POST", "/v1/flips", {"cell": "a", "count": 2, "to": "training"}),
        ("POST", "/v1/flips", {"count": 1, "to": "training", "expected_generation": 3}),
        ("POST", "/v1/versions", {"version": -1}),
        ("POST", "/v1/generate", {"prompt_ids": [-1]}),
        ("POST", "/v1/generate", {"prompt_ids": [1], "top_p": 0}),
        ("POST", "/v1/generate", {"prompt_ids": [1], "max_tokens": 0}),
        ("POST", "/v1/generate", {"prompt_ids": "abc"}),
        ("POST", "/v1/generate", {"prompt_ids": [1], "bogus": 1}),
        ("POST", "/v1/sessions/s/finish", {"reward": "high"}),
        ("POST", "/internal/v1/cells/register", {"cell_id": "a"}),
        ("POST", "/internal/v1/cells/a/sync", {"incarnation": "i", "tokens": [{"request_id": 1}]}),
        ("POST", "/internal/v1/migrations/m/commit", {"cell_id": "a"}),
        ("GET", "/v1/trajectories?limit=0", None),
    ]
    for method, path, body in bad:
        r = c.request(method, path, json=body)
        assert r.status_code == 422, (path, body, r.status_code, r.text)
        assert "detail" in r.json()
    r = c.post("/v1/flips", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = c.post("/v1/generate", json={"prompt_ids": [1]}, headers={"X-Session-Id": "bad id with spaces"})
    assert r.status_code == 422
    cell = FakeCell(c, "a")
    cell.register(), cell.sync()
    cell.events.append({"type": "no_such_event"})
    assert cell.sync(expect=422)["reason"] == "invalid"
    cell.events.append({"type": "scored", "session_id": "x", "start": 0, "old_logprobs": [], "provenance": "guess"})
    assert cell.sync(expect=422)
    assert c.post("/internal/v1/cells/register", json=[1, 2]).status_code == 422


def test_429_when_no_rollout_cell_has_room(harness):
    r = harness.client.post("/v1/generate", json={"prompt_ids": [1]})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and r.json()["reason"] == "no_capacity"
    cell = FakeCell(harness.client, "a", max_running=1)
    cell.register(), cell.sync()
    fut = harness.complete({"prompt_ids": [1], "max_tokens": 3})
    for _ in range(200):
        cell.sync()
        if cell.held:
            break
    r = harness.client.post("/v1/generate", json={"prompt_ids": [2]})
    assert r.status_code == 429
    assert "cellflip_admission_rejected_total 2.0" in harness.client.get("/metrics").text
    for _ in range(10):
        cell.step(3), cell.sync()
    assert fut.result(timeout=60).status_code == 200


def test_session_busy_and_empty_prompt(harness):
    cell = FakeCell(harness.client, "a", max_running=4)
    cell.register(), cell.sync()
    r = harness.client.post("/v1/generate", json={"prompt_ids": []}, headers={"X-Session-Id": "e"})
    assert r.status_code == 422
    fut = harness.complete({"prompt_ids": [1], "max_tokens": 2}, session="busy")
    for _ in range(200):
        cell.sync()
        if cell.held:
            break
    r = harness.client.post("/v1/generate", json={"prompt_ids": [1]}, headers={"X-Session-Id": "busy"})
    assert r.status_code == 409 and r.json()["reason"] == "session_busy"
    assert harness.client.post("/v1/sessions/busy/finish", json={"reward": 1}).status_code == 409
    cell.step(2), cell.sync()
    assert fut.result(timeout=60).status_code == 200


def test_body_limit_counts_declared_and_chunked_bytes(tmp_path):
    app = create_app(make_config(max_body_bytes=1024), db_path=str(tmp_path / "a.sqlite"), tick_interval_s=None)
    with TestClient(app, headers=AUTH) as client:
        big = json.dumps({"prompt_ids": list(range(600))})
        r = client.post("/v1/generate", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["reason"] == "too_large"

        def chunks():
            for _ in range(10):
                yield b" " * 200
            yield b"{}"
        r = client.post("/v1/flips", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert r.status_code == 413
        r = client.post("/v1/versions", json={"version": 1})
        assert r.status_code == 201


def test_body_limit_middleware_streams_chunks():
    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"] = msg["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def run(parts: list[bytes]) -> int:
        queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
        pulled = []

        async def receive():
            pulled.append(1)
            return queue.pop(0)
        sent = []

        async def send(m):
            sent.append(m)
        scope = {"type": "http", "path": "/x", "headers": [(b"transfer-encoding", b"chunked")]}
        await BodySizeLimit(app, 10)(scope, receive, send)
        return sent[0]["status"], len(pulled)

    assert asyncio.run(run([b"12345", b"12345"])) == (200, 2) and seen["body"] == b"1234512345"
    status, pulled = asyncio.run(run([b"123456", b"123456", b"never read"]))
    assert status == 413 and pulled == 2  # stops reading at the first byte past the limit


def test_metrics_names_present(harness):
    text = harness.client.get("/metrics").text
    for name in ("cellflip_cells", "cellflip_cell_role_seconds_total", "cellflip_inflight_requests",
                 "cellflip_kv_blocks_used", "cellflip_migrations_total", "cellflip_migration_downtime_seconds_bucket",
                 "cellflip_migration_bytes_total", "cellflip_flips_total", "cellflip_flip_duration_seconds_bucket",
                 "cellflip_weight_broadcast_seconds_bucket", "cellflip_versions_live", "cellflip_logprob_backlog_tokens",
                 "cellflip_tokens_generated_total", "cellflip_admission_rejected_total",
                 "cellflip_retokenization_drift_total", "cellflip_history_rewrites_total"):
        assert f"# TYPE {name.removesuffix('_bucket').removesuffix('_total')}" in text, name
    cell = FakeCell(harness.client, "a")
    cell.register(), cell.sync()
    harness.client.post("/v1/versions", json={"version": 0})
    cell.events.append({"type": "migration", "migration_id": "m", "outcome": "committed", "bytes": 4096})
    cell.sync()
    harness.clock.advance(1.0)
    harness.tick()
    text = harness.client.get("/metrics").text
    assert "cellflip_migration_bytes_total 4096.0" in text
    # the stall is the scheduler's own measure of a real move (test_cluster_flip), never a cell's word
    assert "cellflip_migration_downtime_seconds_count 0.0" in text
    assert 'cellflip_cell_role_seconds_total{cell="a",state="rollout"}' in text
    assert "cellflip_versions_live 1.0" in text and 'cellflip_logprob_backlog_tokens{version="0"} 0.0' in text

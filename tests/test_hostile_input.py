"""Hostile and malformed input at the control plane's edge (faults issue, "hostile input").

Already covered elsewhere and not repeated here:
  tests/scheduler/test_sched_api.py: every OpenAPI operation and plain route but /healthz
    answers 401 without a token or with a wrong one; a missing or empty token file stops
    start-up; basic 404/422 cases; 429 with Retry-After; 413 for a declared Content-Length
    and for a chunked TestClient body; the size-limit middleware stops reading at limit + 1.
  tests/scheduler/test_idempotency.py: concurrent replays, count flips, refused requests,
    completions and version publishes replayed, key expiry.
  tests/scheduler/test_sched_flips.py: Idempotency-Key replay and reuse (409), stale
    expected_generation (409), illegal transition (409).
  tests/scheduler/test_sched_restart.py: an Idempotency-Key replay after a restart.

Added here: route inventory (gateway, internal, docs) and credential/path variants; auth
before the body is read; fail-closed start-up through both CLIs; loopback binding;
chunked bodies over the limit against a real uvicorn server on every body-taking route;
a 422 matrix of malformed bodies/paths/queries/headers (invalid UTF-8, deep nesting,
NaN/Infinity, booleans/strings/floats for integers, integers past 64 bits); 404 and 409
matrices; and for every rejected request, the store is byte-for-byte the same before and
after (cells, flips, versions, idempotency keys, requests, sessions, tokens).

Decision on docs: /docs, /redoc, /docs/oauth2-redirect and /openapi.json are NOT public.
With a token configured only /healthz answers anonymous callers; an operator who turns
auth on gets nothing but liveness without it. (Without a token, everything is open.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from fastapi.testclient import TestClient

from scheduler.api.app import create_app
from scheduler.api.auth import AgentBudget, ScopedAuth, TokenRegistry
from scheduler.contract.config import ConfigError
from scheduler.contract.config.scheduler import AgentLimits, SchedulerConfig
from tests.scheduler.sched_fakes import Harness, make_config, pump
from tests.scheduler.storecheck import fleet as _fleet
from tests.scheduler.storecheck import rejected as _rejected
from tests.scheduler.storecheck import store_dump

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 4096
"""scheduler.max_body_bytes of the served app."""


# ----------------------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The real app under uvicorn on 127.0.0.1 in a thread (bodies go over real sockets)."""

    def __init__(self, tmp: Path, **sched) -> None:
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        self.db = tmp / "served.sqlite"
        cfg = make_config(auth_token_file=str(token), max_body_bytes=LIMIT, **sched)
        self.app = create_app(cfg, db_path=str(self.db), tick_interval_s=None)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-hostile", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=15.0)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("served"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


# ----------------------------------------------------------------------------- auth


def _inventory(app) -> set[tuple[str, str]]:
    """(method, path template) of every route: plain routes, included routers (walked, so a
    route left out of the OpenAPI document is found too) and the OpenAPI operations."""
    out = set()

    def walk(routes, prefix: str = "") -> None:
        for r in routes:
            if hasattr(r, "effective_route_contexts"):  # FastAPI >= 0.16x: lazily included routers
                for ctx in r.effective_route_contexts():
                    out.update((m, ctx.path) for m in getattr(ctx.original_route, "methods", None) or ())
            elif getattr(r, "routes", None) is not None and not getattr(r, "methods", None):  # Mount
                walk(r.routes, prefix + getattr(r, "path", ""))
            else:
                out.update((m, prefix + r.path) for m in getattr(r, "methods", None) or ())

    walk(app.routes)
    for path, ops in app.openapi()["paths"].items():
        out.update((m.upper(), path) for m in ops)
    return out


def _concrete(path: str) -> str:
    return path.replace("{version}", "1").replace("{", "").replace("}", "")


OPEN_PATHS = ("/healthz", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")
"""Served without a token: liveness, and the API's documentation (no data)."""


def test_token_guards_every_route_and_method_including_gateway_and_internal(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    app = create_app(make_config(auth_token_file=str(tmp_path / "token")), db_path=str(tmp_path / "a.sqlite"),
                     tick_interval_s=None)
    inventory = _inventory(app)
    must = {("POST", "/v1/chat/completions"), ("POST", "/v1/generate"), ("POST", "/v1/flips"),
            ("POST", "/internal/v1/cells/register"), ("POST", "/internal/v1/cells/{cell_id}/sync"),
            ("POST", "/internal/v1/migrations/{migration_id}/commit"),
            ("POST", "/internal/v1/migrations/{migration_id}/abort"), ("GET", "/metrics"),
            ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/docs/oauth2-redirect"),
            ("GET", "/healthz"), ("DELETE", "/v1/versions/{version}"), ("GET", "/v1/trajectories")}
    assert must <= inventory, must - inventory
    paths = {p for _, p in inventory}
    # every path under every method (routed or not), plus unrouted and look-alike paths
    probes = sorted(paths | {"/nope", "/healthz/", "/healthz/x", "/HEALTHZ", "/v1/cells/", "//v1/cells",
                             "/docs/", "/internal/v1/cells", "/v1/healthz"})
    bad_credentials = [{"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"},
                       {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Bearer {TOKEN[:-1]}"},
                       {"Authorization": TOKEN}, {"Authorization": "Bearer"}, {"Cookie": f"token={TOKEN}"},
                       {"X-Api-Key": TOKEN}]

    def refused(r, what) -> None:
        assert r.status_code == 401, (what, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        if r.request.method != "HEAD":
            body = r.json()
            assert body["reason"] == "unauthorized"
            assert body["error"]["type"] == "authentication_error"  # what OpenAI clients read

    with TestClient(app) as client:
        for path in probes:
            url = _concrete(path)
            for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
                r = client.request(method, url, json={}, params={"access_token": TOKEN})
                if path in OPEN_PATHS:  # liveness and the docs, or 405 for other methods
                    assert r.status_code == 200 if method == "GET" else r.status_code in (200, 405)
                else:
                    refused(r, (method, url))
        for method, path in sorted(must - {("GET", p) for p in OPEN_PATHS}):
            for creds in bad_credentials:
                refused(client.request(method, _concrete(path), headers=creds, json={}), (method, path, creds))
        # the docs open without a token (a browser sends none), and with one
        for url in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(url, headers=AUTH).status_code == 200


def test_auth_refuses_before_reading_the_body():
    async def app(scope, receive, send):
        raise AssertionError("the app must not run")

    async def receive():
        raise AssertionError("the body must not be read")

    sent = []

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/v1/flips",
             "headers": [(b"content-length", b"999999999"), (b"authorization", b"Bearer wrong")]}
    asyncio.run(ScopedAuth(app, TokenRegistry({"admin": TOKEN}), [], AgentBudget(AgentLimits()))(scope, receive, send))
    assert sent[0]["status"] == 401


def test_unauthenticated_oversized_chunked_body_is_401_not_413(served):
    def chunks():
        for _ in range(256):
            yield b" " * 1024

    before = store_dump(served.db)
    r = httpx.post(f"{served.url}/v1/flips", content=chunks(), headers={"content-type": "application/json"},
                   timeout=15)
    assert r.status_code == 401 and "content-length" not in r.request.headers
    assert store_dump(served.db) == before


def test_unreadable_token_file_fails_closed(tmp_path, monkeypatch):
    (tmp_path / "tokdir").mkdir()
    with pytest.raises(ConfigError):
        create_app(make_config(auth_token_file=str(tmp_path / "tokdir")), db_path=str(tmp_path / "a.sqlite"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"scheduler": {"auth_token_file": str(tmp_path / "missing"),
                                                 "db_path": str(tmp_path / "db.sqlite")}}))
    served_with = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: served_with.append((a, k)))
    monkeypatch.chdir(tmp_path)

    from scheduler.__main__ import main as scheduler_main
    assert scheduler_main(["--config", str(cfg)]) == 2

    from cells.cli import main as cli_main
    with pytest.raises(SystemExit, match="cannot read token file"):  # one line, no traceback
        cli_main(["scheduler", "--config", str(cfg)])
    assert served_with == [], "a server started without its token"


def test_servers_bind_loopback_unless_told_otherwise(tmp_path, monkeypatch):
    assert SchedulerConfig().host == "127.0.0.1"
    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **k: runs.append(k))
    monkeypatch.chdir(tmp_path)  # `cellflip scheduler` creates the default db directory (runs/)

    from scheduler.__main__ import main as scheduler_main
    assert scheduler_main(["--db", str(tmp_path / "a.sqlite")]) == 0
    assert scheduler_main(["--db", str(tmp_path / "b.sqlite"), "--host", "10.1.2.3"]) == 0

    import cells.cli as cli
    assert cli.main(["scheduler", "--db", str(tmp_path / "c.sqlite")]) == 0
    assert [k["host"] for k in runs] == ["127.0.0.1", "10.1.2.3", "127.0.0.1"]

    seen = {}

    def capture(name):
        def cmd(args) -> int:
            seen[name] = args
            return 0
        return cmd

    monkeypatch.setattr(cli, "cmd_cell", capture("cell"))
    monkeypatch.setattr(cli, "cmd_status", capture("status"))
    cli.main(["cell", "--scheduler", "http://127.0.0.1:1", "--cell-id", "a"])
    cli.main(["status"])
    assert seen["cell"].host == "127.0.0.1"  # the cell's transfer store listens here
    assert seen["status"].scheduler.startswith("http://127.0.0.1:")

    import inspect

    from cells.agent import CellAgent
    from cells.transport.store import StoreHost
    from cells.transport.versions_host import VersionHost
    for listener in (CellAgent.__init__, VersionHost.__init__, StoreHost.__init__):
        assert inspect.signature(listener).parameters["host"].default == "127.0.0.1", listener


def test_no_wildcard_bind_address_in_the_source():
    """Only configs (and --host) may ask for a wildcard address; the code never defaults to one."""
    import ast
    found = []
    for d in ("cells", "scheduler", "bench"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in ("0.0.0.0", "::", "[::]"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_shipped_configs_that_bind_beyond_loopback_require_a_token():
    found = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        sched = data.get("scheduler") if isinstance(data, dict) else None
        if not isinstance(sched, dict):
            continue
        found += 1
        host = sched.get("host", "127.0.0.1")
        if host not in ("127.0.0.1", "localhost", "::1"):
            assert sched.get("auth_token_file"), f"{path.name} binds {host} without auth_token_file"
            assert sched.get("auth", "token") == "token", f"{path.name} binds {host} with auth off"
    assert found >= 2


# ----------------------------------------------------------------------------- 413


BODY_ROUTES = ["/v1/flips", "/v1/versions", "/v1/sessions/s/finish", "/v1/generate", "/v1/chat/completions",
               "/internal/v1/cells/register", "/internal/v1/cells/c/sync", "/internal/v1/migrations/m/commit",
               "/internal/v1/migrations/m/abort"]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_chunked_body_over_the_limit_is_413_on_a_real_server(served, path):
    sent = []

    def chunks():  # no Content-Length: httpx sends Transfer-Encoding: chunked
        yield b'{"pad": "'
        for _ in range(64):
            sent.append(1)
            yield b"x" * 256
        yield b'"}'

    before = store_dump(served.db)
    r = served.http.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413, (path, r.status_code, r.text[:200])
    body = r.json()
    assert body["reason"] == "too_large" and body["error"]["code"] == "body_too_large"
    assert store_dump(served.db) == before


def test_limit_counts_bytes_not_chunks(served):
    """A chunked body of exactly the limit is read whole; one byte more is refused."""
    def body(n: int, version: int) -> list[bytes]:
        text = json.dumps({"version": version}).encode()
        text = text[:-1] + b" " * (n - len(text)) + b"}"
        assert len(text) == n
        return [text[i:i + 100] for i in range(0, n, 100)]

    r = served.http.post("/v1/versions", content=iter(body(LIMIT + 1, 1000)),
                         headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = served.http.post("/v1/versions", content=iter(body(LIMIT, 1000)), headers={"content-type": "application/json"})
    assert r.status_code == 201 and r.json()["version"] == 1000
    # a declared Content-Length over the limit is refused without reading
    r = served.http.post("/v1/versions", content=b" " * (LIMIT + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.request.headers["content-length"] == str(LIMIT + 1)


# ----------------------------------------------------------------------------- 422

_DEEP = "[" * 2000 + "]" * 2000  # under the size limit, past the JSON parser's recursion limit
_NESTED = "[" * 900 + "1" + "]" * 900  # parseable, deep
JSON = {"content-type": "application/json"}
MALFORMED = [
    # body that is not JSON text
    ("POST", "/v1/generate", {"content": _DEEP, "headers": JSON}),
    ("POST", "/internal/v1/cells/register", {"content": _DEEP, "headers": JSON}),
    # deep but parseable: the 422 echoes the input without deep recursion
    ("POST", "/v1/flips", {"content": '{"to": "training", "cell": ' + _NESTED + "}", "headers": JSON}),
    ("POST", "/internal/v1/cells/register", {"content": '{"cell_id": ' + _NESTED + "}", "headers": JSON}),
    ("POST", "/internal/v1/cells/c/sync", {"content": '{"incarnation": "i", "events": [{"type": "migration", "x": '
                                                      + _NESTED.replace("1", str(1 << 70)) + "}]}", "headers": JSON}),
    ("POST", "/v1/versions", {"content": b"", "headers": JSON}),
    ("POST", "/v1/versions", {"content": b"null", "headers": JSON}),
    ("POST", "/v1/versions", {"content": b'"1"', "headers": JSON}),
    ("POST", "/v1/versions", {"content": b"[1]", "headers": JSON}),
    ("POST", "/v1/versions", {"content": b'{"version": 1', "headers": JSON}),
    ("POST", "/v1/versions", {"content": b'{"version": 1}', "headers": {"content-type": "text/plain"}}),
    # numbers Python's json reads but JSON cannot carry back (the 422 must still serialize)
    ("POST", "/v1/sessions/s/finish", {"content": b'{"reward": NaN}', "headers": JSON}),
    ("POST", "/v1/sessions/s/finish", {"content": b'{"reward": -Infinity}', "headers": JSON}),
    ("POST", "/v1/generate", {"content": b'{"prompt_ids": [1], "temperature": NaN}', "headers": JSON}),
    ("POST", "/v1/generate", {"content": b'{"prompt_ids": [1], "seed": 1e400}', "headers": JSON}),
    ("POST", "/v1/flips", {"content": b'{"cell": "a", "to": "training", "expected_generation": Infinity}',
                           "headers": JSON}),
    ("POST", "/internal/v1/cells/register", {"content": b'{"cell_id": NaN}', "headers": JSON}),
    ("POST", "/v1/chat/completions", {"content": b'{"messages": [{"role": "user", "content": "x"}], '
                                                 b'"temperature": NaN}', "headers": JSON}),
    # wrong JSON types for integers: booleans, strings, fractions
    ("POST", "/v1/versions", {"json": {"version": True}}),
    ("POST", "/v1/versions", {"json": {"version": "3"}}),
    ("POST", "/v1/versions", {"json": {"version": 1.5}}),
    ("POST", "/v1/sessions/s/finish", {"json": {"reward": False}}),
    ("POST", "/v1/generate", {"json": {"prompt_ids": [True]}}),
    ("POST", "/v1/flips", {"json": {"count": True, "to": "training"}}),
    # integers past 64 bits, in a path, a query, a body, the cell protocol
    ("DELETE", f"/v1/versions/{1 << 63}", {}),
    ("DELETE", "/v1/versions/-1", {}),
    ("GET", f"/v1/trajectories?cursor={1 << 63}", {}),
    ("GET", f"/v1/trajectories?limit={1 << 70}", {}),
    ("POST", "/v1/versions", {"json": {"version": 1 << 64}}),
    ("POST", "/v1/generate", {"json": {"prompt_ids": [1 << 64]}}),
    ("POST", "/internal/v1/cells/register", {"json": {"cell_id": "big", "incarnation": "i", "address": "a:1",
                                                      "store_port": 1 << 64}}),
    ("POST", "/internal/v1/cells/register", {"json": {"cell_id": "big", "incarnation": "i", "address": "a:1",
                                                      "store_port": 1, "version": 1 << 63}}),
    ("POST", "/internal/v1/cells/c/sync", {"json": {"incarnation": "i", "summary": {"version": 1 << 63}}}),
    ("POST", "/internal/v1/migrations/m/commit", {"json": {"cell_id": "c", "incarnation": "i", "request_id": "r",
                                                           "epoch": 1 << 64, "num_tokens": 0}}),
    # headers
    ("POST", "/v1/flips", {"json": {"cell": "a", "to": "training"}, "headers": {"Idempotency-Key": "k" * 300}}),
    ("POST", "/v1/generate", {"json": {"prompt_ids": [1]}, "headers": {"X-Session-Id": "a b"}}),
    ("POST", "/v1/generate", {"json": {"prompt_ids": [1]}, "headers": {"X-Session-Id": "x" * 300}}),
]


NOT_UTF8 = [b"\xff\xfe\xfa{}", b'{"to": "training", "cell": "\xc3\x28"}',
            b'{"to": "training", "cell": "\xed\xa0\x80"}',  # a raw (UTF-8-encoded) lone surrogate
            b'{"messages": [{"role": "user", "content": "\xed\xb3\xbf"}]}']
NOT_UTF8_ROUTES = ["/v1/flips", "/v1/versions", "/v1/sessions/s/finish", "/v1/generate", "/v1/chat/completions",
                   "/v1/trainer/report", "/v1/trajectories/dropped", "/v1/tokens", "/internal/v1/cells/register",
                   "/internal/v1/cells/c/sync", "/internal/v1/migrations/m/commit"]


@pytest.mark.parametrize("path", NOT_UTF8_ROUTES)
def test_a_body_that_is_not_utf8_is_400_on_every_route_and_changes_nothing(served, path):
    """One body decoder in front of every route: raw surrogate bytes (which Python's JSON reader
    would pass through as a lone surrogate, a 500 further down) and other invalid UTF-8 are 400."""
    for raw in NOT_UTF8:
        r = _rejected(served.http, served.db, "POST", path, 400, content=raw, headers=JSON)
        assert r.json()["reason"] == "invalid_text"


@pytest.mark.parametrize("method,path,kw", MALFORMED, ids=[f"{i}-{m} {p[:40]}" for i, (m, p, _) in enumerate(MALFORMED)])
def test_malformed_requests_are_422_and_change_nothing(served, method, path, kw):
    r = _rejected(served.http, served.db, method, path, 422, **kw)
    body = r.json()
    assert "detail" in body or "error" in body  # the API's shape, or the gateway's OpenAI error object
    text = r.text
    assert "NaN" not in text and "Infinity" not in text  # the answer itself is strict JSON
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in the answer"))


def test_non_finite_inputs_are_quoted_in_validation_errors(served):
    r = served.http.post("/v1/sessions/s/finish", content=b'{"reward": NaN}', headers=JSON)
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "reward"] and err["input"] == "nan"


# ----------------------------------------------------------------------------- 404


UNKNOWN = [
    ("GET", "/v1/cells/nope", {}),
    ("GET", "/v1/flips/nope", {}),
    ("GET", "/v1/sessions/nope", {}),
    ("DELETE", "/v1/versions/4242", {}),
    ("POST", "/v1/sessions/nope/finish", {"json": {"reward": 1.0}}),
    ("POST", "/v1/flips", {"json": {"cell": "nope", "to": "training"}}),
    ("POST", "/v1/flips", {"json": {"cell": "nope", "to": "training", "expected_generation": 0},
                           "headers": {"Idempotency-Key": "unknown-cell"}}),
    ("POST", "/internal/v1/cells/nope/sync", {"json": {"incarnation": "i"}}),
    ("POST", "/internal/v1/migrations/nope/commit", {"json": {"cell_id": "c", "incarnation": "i", "request_id": "r",
                                                              "epoch": 0, "num_tokens": 0}}),
    ("POST", "/internal/v1/migrations/nope/abort", {"json": {"cell_id": "c", "incarnation": "i"}}),
]


@pytest.mark.parametrize("method,path,kw", UNKNOWN, ids=[f"{m} {p}" for m, p, _ in UNKNOWN])
def test_unknown_ids_are_404_and_change_nothing(served, method, path, kw):
    r = _rejected(served.http, served.db, method, path, 404, **kw)
    assert r.json()["reason"] == "not_found"


# ----------------------------------------------------------------------------- 409


def test_illegal_transitions_are_409_and_change_nothing(harness):
    h, c, db = harness, harness.client, harness.db_path
    c0, c1 = _fleet(h, 2)
    assert c.post("/v1/versions", json={"version": 0}).status_code == 201
    assert c.post("/v1/versions", json={"version": 5}).status_code == 201
    gen = c.get("/v1/cells/c0").json()["generation"]

    def conflict(method, path, reason, **kw):
        r = _rejected(c, db, method, path, 409, **kw)
        assert r.json()["reason"] == reason, r.text

    conflict("POST", "/v1/flips", "illegal_transition", json={"cell": "c0", "to": "rollout"})
    conflict("POST", "/v1/flips", "stale_generation", json={"cell": "c0", "to": "training",
                                                            "expected_generation": gen + 1})
    conflict("POST", "/v1/flips", "no_cells", json={"count": 2, "to": "training"})
    conflict("POST", "/v1/versions", "version_exists", json={"version": 5})
    conflict("POST", "/v1/versions", "version_not_newer", json={"version": 3})
    conflict("DELETE", "/v1/versions/0", "version_in_use")
    assert c.post("/v1/flips", json={"cell": "c1", "to": "training"}).status_code == 202
    conflict("POST", "/v1/flips", "flip_in_progress", json={"cell": "c1", "to": "training"})
    conflict("POST", "/v1/flips", "min_rollout_cells", json={"cell": "c0", "to": "training"})

    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 3}, session="s1")
    pump([c0, c1], until=fut, harness=h)
    assert fut.result(timeout=60).status_code == 200
    first = c.post("/v1/sessions/s1/finish", json={"reward": 1.0})
    assert first.status_code == 200
    before = store_dump(db)
    replay = c.post("/v1/sessions/s1/finish", json={"reward": 1.0})
    assert replay.status_code == 200 and replay.json() == first.json()  # a replay is the original answer
    assert store_dump(db) == before
    conflict("POST", "/v1/sessions/s1/finish", "session_finished", json={"reward": 0.0})
    conflict("POST", "/v1/generate", "session_finished", json={"prompt_ids": [1, 2, 3]},
             headers={"X-Session-Id": "s1"})


# ----------------------------------------------------------------------------- 429 without cells


@pytest.mark.parametrize("path,body", [
    ("/v1/generate", {"prompt_ids": [1, 2]}),
    ("/v1/generate", {"prompt_ids": [1, 2], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
def test_completions_without_cells_are_429_at_once(harness, path, body):
    t0 = time.monotonic()
    with contextlib.closing(harness.client.post(path, json=body)) as r:
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
    assert time.monotonic() - t0 < 10

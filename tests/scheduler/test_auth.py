"""Auth on by default: generated token files (0600), one per scope, every route but /healthz and
the docs refused without a token, the scrape token reading /metrics only, auth off only on
loopback, clients finding the token of their scope. Route-by-route scopes: tests/security/."""

from __future__ import annotations

import stat

import pytest
from fastapi.testclient import TestClient
from sched_fakes import make_config

from scheduler.api.app import create_app
from scheduler.contract.config import ConfigError
from scheduler.contract.config.scheduler import SchedulerConfig
from scheduler.contract.tokens import (
    SCOPE_ENV,
    SCOPE_FILE,
    SCOPES,
    TOKEN_ENV,
    client_token,
    default_token_path,
    server_token,
    server_tokens,
)
from tests.conftest import AUTH


@pytest.fixture
def no_env_token(monkeypatch):
    for var in SCOPE_ENV.values():
        monkeypatch.delenv(var, raising=False)


def test_first_start_generates_a_private_token_per_scope_and_requires_them(tmp_path, no_env_token):
    db = tmp_path / "runs" / "db.sqlite"
    app = create_app(make_config(), db_path=str(db), tick_interval_s=None)
    files = {scope: db.parent / SCOPE_FILE[scope] for scope in SCOPES}
    for f in files.values():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    tokens = {scope: f.read_text().strip() for scope, f in files.items()}
    assert all(len(t) >= 32 for t in tokens.values()) and len(set(tokens.values())) == len(SCOPES)
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        for path in ("/v1/cells", "/v1/versions", "/metrics"):
            assert c.get(path).status_code == 401, path
        assert c.post("/v1/flips", json={"cell": "x", "to": "training"}).status_code == 401
        assert c.post("/internal/v1/cells/register", json={}).status_code == 401
        ok = {"Authorization": f"Bearer {tokens['admin']}"}
        assert c.get("/v1/cells", headers=ok).status_code == 200
        assert c.get("/metrics", headers=ok).status_code == 200
        ro = {"Authorization": f"Bearer {tokens['scrape']}"}
        assert c.get("/metrics", headers=ro).status_code == 200
        assert c.get("/v1/cells", headers=ro).status_code == 403  # the scrape token reads metrics only
        assert c.post("/v1/flips", json={"cell": "x", "to": "training"}, headers=ro).status_code == 403
        trainer = {"Authorization": f"Bearer {tokens['trainer']}"}
        assert c.get("/v1/cells", headers=trainer).status_code == 200
        # two Authorization headers: refused, whichever comes last
        both = [("authorization", f"Bearer {tokens['scrape']}"), ("authorization", f"Bearer {tokens['admin']}")]
        assert c.get("/v1/cells", headers=both).status_code == 401
    # a restart keeps the same tokens: clients that read them once keep working
    create_app(make_config(), db_path=str(db), tick_interval_s=None)
    assert {scope: f.read_text().strip() for scope, f in files.items()} == tokens


def test_two_scopes_sharing_a_token_stop_start_up(tmp_path, no_env_token, monkeypatch):
    monkeypatch.setenv(SCOPE_ENV["cell"], "same-token")
    monkeypatch.setenv(SCOPE_ENV["agent"], "same-token")
    with pytest.raises(ConfigError, match="same token"):
        server_tokens(SchedulerConfig(db_path=str(tmp_path / "db.sqlite")))


def test_environment_token_is_used_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    app = create_app(make_config(), db_path=str(tmp_path / "db.sqlite"), tick_interval_s=None)
    assert not (tmp_path / "api.token").exists()
    with TestClient(app) as c:
        assert c.get("/v1/cells", headers={"Authorization": "Bearer from-env"}).status_code == 200
        assert c.get("/v1/cells", headers={"Authorization": "Bearer other"}).status_code == 401


def test_auth_off_only_on_loopback(tmp_path):
    app = create_app(make_config(auth="none"), db_path=str(tmp_path / "db.sqlite"), tick_interval_s=None)
    with TestClient(app) as c:
        assert c.get("/v1/cells").status_code == 200
    for host in ("192.0.2.7", "example.org", "::"):
        with pytest.raises(ConfigError, match="non-loopback"):
            create_app(make_config(auth="none", host=host), db_path=str(tmp_path / "db.sqlite"))
    for host in ("127.0.0.1", "::1", "localhost"):
        assert server_token(SchedulerConfig(auth="none", host=host, db_path=str(tmp_path / "d"))) is None


def test_clients_find_the_token_the_scheduler_uses(tmp_path, no_env_token, monkeypatch):
    sched = SchedulerConfig(db_path=str(tmp_path / "runs" / "db.sqlite"))
    assert client_token(sched) is None  # nothing generated yet: send none (the server says 401)
    token = server_token(sched)
    assert client_token(sched) == token == default_token_path(sched).read_text().strip()
    tokens = server_tokens(sched)
    for scope in SCOPES:  # each client finds its own scope's token, never the admin's
        assert client_token(sched, scope=scope) == tokens[scope]
    monkeypatch.setenv(SCOPE_ENV["cell"], "cell-from-env")
    assert client_token(sched, scope="cell") == "cell-from-env"
    assert client_token(sched, scope="trainer") == tokens["trainer"]
    monkeypatch.setenv(TOKEN_ENV, "env-wins-over-the-generated-file")
    assert client_token(sched) == "env-wins-over-the-generated-file"
    explicit = tmp_path / "explicit.token"
    explicit.write_text("explicit\n")
    assert client_token(sched, token_file=str(explicit)) == "explicit"
    assert client_token(sched.model_copy(update={"auth_token_file": str(explicit)})) == "explicit"
    assert client_token(sched.model_copy(update={"auth": "none"})) is None
    (tmp_path / "empty.token").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        client_token(sched, token_file=str(tmp_path / "empty.token"))


def test_docs_are_served_from_local_assets_and_declare_the_bearer_scheme(tmp_path):
    """A browser sends no bearer header: the pages, their assets and the document open without
    one (they hold no data); Swagger's Authorize button carries the token on calls."""
    app = create_app(make_config(), db_path=str(tmp_path / "db.sqlite"), tick_interval_s=None)
    with TestClient(app) as c:
        for page, asset in (("/docs", "/docs-assets/swagger-ui-bundle.js"), ("/redoc", "/docs-assets/redoc.standalone.js")):
            html = c.get(page)
            assert html.status_code == 200 and asset in html.text, page
            assert "cdn." not in html.text and "https://" not in html.text.replace("https://fastapi.tiangolo.com", "")
            js = c.get(asset)
            assert js.status_code == 200 and len(js.content) > 100_000
        doc = c.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert doc["security"] == [{"bearer": []}]
        assert doc["paths"]["/healthz"]["get"]["security"] == []
        assert doc["paths"]["/v1/flips"]["post"]["x-cellflip-scopes"] == ["admin", "trainer"]
        assert c.get("/docs-assets/../api.token").status_code in (401, 404)
        assert c.get("/v1/cells").status_code == 401  # the calls still need a token
        assert c.get("/v1/cells", headers=AUTH).status_code == 200

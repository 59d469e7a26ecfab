"""Auth on by default: a generated token file (0600), every route but /healthz refused without
it, a read-only scrape token for /metrics, auth off only on loopback, one token for all clients."""

from __future__ import annotations

import stat

import pytest
from fastapi.testclient import TestClient
from sched_fakes import make_config

from scheduler.api.app import create_app
from scheduler.contract.config import ConfigError, SchedulerConfig
from scheduler.contract.tokens import TOKEN_ENV, client_token, default_token_path, server_token
from tests.conftest import AUTH


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_first_start_generates_a_private_token_and_requires_it(tmp_path, no_env_token):
    db = tmp_path / "runs" / "db.sqlite"
    app = create_app(make_config(), db_path=str(db), tick_interval_s=None)
    tok_file, scrape_file = db.parent / "api.token", db.parent / "metrics.token"
    assert stat.S_IMODE(tok_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(scrape_file.stat().st_mode) == 0o600
    token, scrape = tok_file.read_text().strip(), scrape_file.read_text().strip()
    assert len(token) >= 32 and token != scrape
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        for path in ("/v1/cells", "/v1/versions", "/metrics", "/docs", "/openapi.json", "/docs-assets/swagger-ui.css"):
            assert c.get(path).status_code == 401, path
        assert c.post("/v1/flips", json={"cell": "x", "to": "training"}).status_code == 401
        assert c.post("/internal/v1/cells/register", json={}).status_code == 401
        ok = {"Authorization": f"Bearer {token}"}
        assert c.get("/v1/cells", headers=ok).status_code == 200
        assert c.get("/metrics", headers=ok).status_code == 200
        ro = {"Authorization": f"Bearer {scrape}"}
        assert c.get("/metrics", headers=ro).status_code == 200
        assert c.get("/v1/cells", headers=ro).status_code == 401  # the scrape token reads metrics only
        assert c.post("/v1/flips", json={"cell": "x", "to": "training"}, headers=ro).status_code == 401
    # a restart keeps the same token: clients that read it once keep working
    create_app(make_config(), db_path=str(db), tick_interval_s=None)
    assert tok_file.read_text().strip() == token


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
    app = create_app(make_config(), db_path=str(tmp_path / "db.sqlite"), tick_interval_s=None)
    with TestClient(app, headers=AUTH) as c:
        for page, asset in (("/docs", "/docs-assets/swagger-ui-bundle.js"), ("/redoc", "/docs-assets/redoc.standalone.js")):
            html = c.get(page)
            assert html.status_code == 200 and asset in html.text, page
            assert "cdn." not in html.text and "https://" not in html.text.replace("https://fastapi.tiangolo.com", "")
            js = c.get(asset)
            assert js.status_code == 200 and len(js.content) > 100_000
        doc = c.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert doc["security"] == [{"bearer": []}]
        assert c.get("/docs-assets/../api.token").status_code in (401, 404)

"""Least privilege: every route declares its token scope, and every route is called with every
scope's token. In scope: the middleware lets it through (not 401/403). Out of scope: 401, 403 or
404, and the store is byte-for-byte what it was. An agent sees only its own sessions; tokens
are made and revoked at run time (hashed, effective at once, across restarts); each agent token
has a rate and concurrency budget."""

from __future__ import annotations

import pytest

from scheduler.api.scopes import PUBLIC, ROUTE_SCOPES, route_keys
from scheduler.contract.tokens import SCOPE_ENV, SCOPES, TOKEN_ENV, server_tokens
from tests.scheduler.sched_fakes import FakeCell, Harness, make_config, pump, until_held
from tests.scheduler.storecheck import store_dump

ATTACKS: dict[tuple[str, str], dict] = {
    ("POST", "/v1/flips"): {"json": {"count": 1, "to": "training"}},
    ("POST", "/v1/versions"): {"json": {"version": 7, "source": {"host": "203.0.113.9", "port": 29500}}},
    ("DELETE", "/v1/versions/{version}"): {},
    ("POST", "/v1/sessions/{session_id}/finish"): {"json": {"reward": 1.0, "group_id": "g"}},
    ("POST", "/v1/trajectories/dropped"): {"json": {"reason": "deadline", "groups": 1, "trajectories": 2}},
    ("POST", "/v1/trainer/report"): {"json": {"batch_size": 8, "steps_in_progress": 1, "max_cells_per_step": 2}},
    ("POST", "/v1/generate"): {"json": {"prompt_ids": [1, 2, 3], "max_tokens": 2}},
    ("POST", "/v1/chat/completions"): {"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}},
    ("POST", "/internal/v1/cells/register"): {"json": {
        "cell_id": "evil-3", "incarnation": "i1", "address": "203.0.113.9:9000", "store_port": 29500,
        "capabilities": {"kv_export": True, "scoring": True, "weight_update": "staged", "batch_invariant": True,
                         "block_size": 16}, "kv_blocks_total": 64, "max_running": 4, "version": 0}},
    ("POST", "/internal/v1/cells/{cell_id}/sync"): {"json": {"incarnation": "x", "summary": {
        "inflight": 0, "kv_blocks_used": 0, "kv_blocks_total": 64, "version": 0, "request_ids": [], "role": "rollout"}}},
    ("POST", "/internal/v1/migrations/{migration_id}/commit"): {"json": {
        "cell_id": "c0", "incarnation": "x", "request_id": "r", "epoch": 1, "num_tokens": 1,
        "tail": {"start": 0, "records": []}}},
    ("POST", "/internal/v1/migrations/{migration_id}/abort"): {"json": {"cell_id": "c0", "incarnation": "x",
                                                                        "reason": "t"}},
    ("POST", "/v1/tokens"): {"json": {"scope": "admin", "name": "stolen"}},
    ("DELETE", "/v1/tokens/{token_id}"): {},
    ("POST", "/v1/jobs"): {"json": {"name": "evil", "model": "toy"}},
    ("DELETE", "/v1/jobs/{name}"): {},
    ("POST", "/v1/jobs/{name}/cells"): {"json": {"cell": "c0"}},
}
"""What a caller out of scope would send: each body would change the store if it were let through."""

IN_SCOPE_BODY = {("POST", "/v1/generate"): {"json": {"prompt_ids": "not ids"}},
                 ("POST", "/v1/chat/completions"): {"content": b"{", "headers": {"content-type": "application/json"}}}
"""In scope, a turn would wait on a cell: a malformed body shows the middleware let it through (422)."""

PARAMS = {"cell_id": "c0", "flip_id": "f-1", "version": "0", "session_id": "s-trainer", "migration_id": "m-1",
          "token_id": "agent-bootstrap-0", "path": "swagger-ui.css", "name": "default"}


def _url(method: str, path: str) -> str:
    if method == "MOUNT":
        return path + "/swagger-ui.css"
    for k, v in PARAMS.items():
        path = path.replace("{" + k + "}", v)
    return path


@pytest.fixture
def scoped(tmp_path, monkeypatch):
    """A harness with every scope's bootstrap token (admin: the suite's $CELLFLIP_API_TOKEN)."""
    for scope in SCOPES:
        if scope != "admin":
            monkeypatch.delenv(SCOPE_ENV[scope], raising=False)
    h = Harness(str(tmp_path / "sched.sqlite"))
    h.tokens = server_tokens(make_config().scheduler.model_copy(update={"db_path": h.db_path}))
    h.auth = {s: {"Authorization": f"Bearer {t}"} for s, t in h.tokens.items()}
    yield h
    h.close()


def test_every_served_route_declares_its_scope(scoped):
    served = {key for key, _ in route_keys(scoped.app.routes)}
    must = {("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"),
            ("MOUNT", "/docs-assets"), ("POST", "/internal/v1/cells/register"), ("POST", "/v1/tokens")}
    assert must <= served, must - served
    assert served - ROUTE_SCOPES.keys() == set(), "routes without a declared scope"
    assert ROUTE_SCOPES.keys() - served == set(), "declared scopes of routes no longer served"
    # the agent scope reaches no route that flips, publishes, registers or reads trajectories
    agent_routes = {k for k, v in ROUTE_SCOPES.items() if "agent" in v}
    assert agent_routes == {("POST", "/v1/chat/completions"), ("POST", "/v1/generate"),
                            ("GET", "/v1/sessions/{session_id}")}


def test_every_route_with_every_scope(scoped):
    h = scoped
    cell = FakeCell(h.client, "c0", headers=h.auth["cell"])
    cell.register(), cell.sync()
    h.client.portal.call(h.ctl.store.sessions.ensure, "s-trainer")
    refused_checked = 0
    for key, _ in route_keys(h.app.routes):
        method, path = key
        allowed = ROUTE_SCOPES[key]
        for scope in SCOPES:
            ok = allowed == PUBLIC or scope == "admin" or scope in allowed
            kw = IN_SCOPE_BODY.get(key, ATTACKS.get(key, {})) if ok else ATTACKS.get(key, {})
            headers = {**kw.get("headers", {}), **h.auth[scope]}
            before = store_dump(h.db_path)
            r = h.client.request("GET" if method == "MOUNT" else method, _url(method, path), headers=headers,
                                 **{k: v for k, v in kw.items() if k != "headers"})
            if ok:
                assert r.status_code not in (401, 403), (scope, key, r.status_code, r.text[:200])
                continue
            assert r.status_code in (401, 403, 404), (scope, key, r.status_code, r.text[:200])
            if r.status_code == 403:
                assert r.json()["reason"] == "forbidden" and scope in r.json()["detail"]
            assert store_dump(h.db_path) == before, f"{scope} token on {key} changed the store"
            refused_checked += 1
    assert refused_checked > 60  # 5 scopes × 30 routes: each non-admin scope is refused most of them
    # the store comparison can fail: the same kind of call, in scope, changes it
    before = store_dump(h.db_path)
    assert h.client.post("/v1/tokens", json={"scope": "agent"}, headers=h.auth["admin"]).status_code == 201
    assert store_dump(h.db_path) != before


def _generate(h, session: str, auth: dict, cell: FakeCell, **extra):
    fut = h.complete({"prompt_ids": [4, 5, 6], "max_tokens": 3, **extra}, session=session, headers=auth)
    until_held(cell, fut)
    pump([cell], until=fut)
    return fut.result(timeout=60)


def test_an_agent_sees_only_its_own_sessions(scoped):
    h = scoped
    cell = FakeCell(h.client, "c0", headers=h.auth["cell"])
    cell.register(), cell.sync()
    mint = lambda: h.client.post("/v1/tokens", json={"scope": "agent"}, headers=h.auth["admin"]).json()  # noqa: E731
    a, b = mint(), mint()
    auth_a, auth_b = ({"Authorization": f"Bearer {t['token']}"} for t in (a, b))
    r = _generate(h, "mine", auth_a, cell)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
    assert h.client.get("/v1/sessions/mine", headers=auth_a).status_code == 200
    unknown = h.client.get("/v1/sessions/nobody-has-this", headers=auth_b)
    other = h.client.get("/v1/sessions/mine", headers=auth_b)
    assert other.status_code == unknown.status_code == 404
    assert other.json()["reason"] == unknown.json()["reason"] == "not_found"
    before = store_dump(h.db_path)
    assert h.client.post("/v1/generate", json={"prompt_ids": [4, 5, 6, 7]}, headers={
        **auth_b, "X-Session-Id": "mine"}).status_code == 404
    chat = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                         headers={**auth_b, "X-Session-Id": "mine"})
    assert chat.status_code == 404, chat.text
    assert store_dump(h.db_path) == before  # another agent's attempts recorded nothing
    # the trainer reads every session; an agent reads none it did not open
    assert h.client.get("/v1/sessions/mine", headers=h.auth["trainer"]).json()["token_ids"][:3] == [4, 5, 6]
    h.client.portal.call(h.ctl.store.sessions.ensure, "opened-by-trainer")
    assert h.client.get("/v1/sessions/opened-by-trainer", headers=auth_a).status_code == 404
    # the agent cannot close its own session with a reward of its choosing
    assert h.client.post("/v1/sessions/mine/finish", json={"reward": 1.0}, headers=auth_a).status_code == 403
    assert h.client.post("/v1/sessions/mine/finish", json={"reward": 1.0}, headers=h.auth["trainer"]).status_code == 200


def test_tokens_made_and_revoked_at_run_time_hashed_and_durable(scoped, tmp_path):
    h = scoped
    made = h.client.post("/v1/tokens", json={"scope": "trainer", "name": "ci"}, headers=h.auth["admin"])
    assert made.status_code == 201, made.text
    tok = made.json()
    mine = {"Authorization": f"Bearer {tok['token']}"}
    assert h.client.get("/v1/cells", headers=mine).status_code == 200
    assert h.client.post("/v1/tokens", json={"scope": "admin"}, headers=mine).status_code == 403
    dump = repr(store_dump(h.db_path))
    assert tok["token"] not in dump and all(t not in dump for t in h.tokens.values())  # only digests kept
    listed = {t["id"]: t for t in h.client.get("/v1/tokens", headers=h.auth["admin"]).json()["tokens"]}
    assert listed[tok["id"]]["scope"] == "trainer" and listed[tok["id"]]["revoked_at"] is None
    assert {t["scope"] for t in listed.values() if t["origin"] == "bootstrap"} == set(SCOPES)
    assert h.client.delete(f"/v1/tokens/{tok['id']}", headers=h.auth["admin"]).status_code == 200
    assert h.client.get("/v1/cells", headers=mine).status_code == 401  # at once, no restart
    # a bootstrap token revoked by id: refused at once, and after a restart on the same store
    cell_id = next(i for i, t in listed.items() if t["scope"] == "cell" and t["origin"] == "bootstrap")
    assert h.client.delete(f"/v1/tokens/{cell_id}", headers=h.auth["admin"]).status_code == 200
    assert h.client.post("/internal/v1/cells/register", json={}, headers=h.auth["cell"]).status_code == 401
    # the last admin token cannot be revoked: nothing could make tokens after it
    admin_id = next(i for i, t in listed.items() if t["scope"] == "admin")
    last = h.client.delete(f"/v1/tokens/{admin_id}", headers=h.auth["admin"])
    assert last.status_code == 409 and last.json()["reason"] == "last_admin_token"
    assert h.client.post("/v1/tokens", json={"scope": "root"}, headers=h.auth["admin"]).status_code == 422
    assert h.client.delete("/v1/tokens/tok-nope", headers=h.auth["admin"]).status_code == 404
    again = Harness(h.db_path)
    try:
        assert again.client.get("/v1/cells", headers=mine).status_code == 401
        assert again.client.post("/internal/v1/cells/register", json={}, headers=h.auth["cell"]).status_code == 401
        assert again.client.get("/v1/cells", headers=h.auth["trainer"]).status_code == 200
    finally:
        again.close()


def test_each_agent_token_has_its_own_rate_and_concurrency_budget(tmp_path, monkeypatch):
    for scope in SCOPES:
        if scope != "admin":
            monkeypatch.delenv(SCOPE_ENV[scope], raising=False)
    h = Harness(str(tmp_path / "sched.sqlite"),
                agent_limits={"requests_per_s": 0.01, "burst": 3, "max_concurrent_sessions": 1})
    try:
        tokens = server_tokens(make_config().scheduler.model_copy(update={"db_path": h.db_path}))
        agent = {"Authorization": f"Bearer {tokens['agent']}"}
        other = {"Authorization": "Bearer " + h.client.post(
            "/v1/tokens", json={"scope": "agent"}).json()["token"]}
        cell = FakeCell(h.client, "c0", headers={"Authorization": f"Bearer {tokens['cell']}"})
        cell.register(), cell.sync()
        # one turn in flight: a second session's turn is refused, with nothing recorded
        fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 2}, session="first", headers=agent)
        until_held(cell, fut)
        before = store_dump(h.db_path)
        busy = h.client.post("/v1/generate", json={"prompt_ids": [1]}, headers={**agent, "X-Session-Id": "second"})
        assert busy.status_code == 429 and busy.json()["reason"] == "rate_limited", busy.text
        assert int(busy.headers["retry-after"]) >= 1
        assert store_dump(h.db_path) == before
        pump([cell], until=fut)
        assert fut.result(timeout=60).status_code == 200
        # three requests are the burst (two above, one here): the fourth is over the rate; another
        # agent token is not
        assert h.client.get("/v1/sessions/first", headers=agent).status_code == 200
        limited = h.client.get("/v1/sessions/first", headers=agent)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert h.client.get("/v1/sessions/first", headers=other).status_code == 404  # its own budget
        for _ in range(5):  # trainer and admin tokens have no budget
            assert h.client.get("/v1/sessions/first", headers={"Authorization": f"Bearer {tokens['trainer']}"}
                                ).status_code == 200
    finally:
        h.close()


def test_admin_token_from_the_environment_keeps_working(scoped):
    import os

    assert scoped.tokens["admin"] == os.environ[TOKEN_ENV]
    assert scoped.client.get("/v1/tokens", headers={"Authorization": f"Bearer {os.environ[TOKEN_ENV]}"}
                             ).status_code == 200

"""Schemathesis against the served OpenAPI document: no 5xx, every answer matches its schema.

Runs in-process over ASGI (`schemathesis.openapi.from_dict` of the document the app serves at
/openapi.json, bound to the app) with a fixed seed and a bounded
number of examples (positive and negative data, schemathesis' default phases), so a run is
reproducible and takes well under a minute on two slow cores.

Two apps, so that nothing blocks: the public API and the gateway run with no cell ever
registered (POST /v1/generate and /v1/chat/completions answer 429 at once instead of
waiting for a cell to decode), and the cell protocol (/internal/...) runs on an app of its
own, where the cells it registers never see a completion. Every call has a read timeout,
so a hang is a failure, not a stall.

Checks: not_a_server_error, status_code_conformance, content_type_conformance,
response_schema_conformance, response_headers_conformance. Not run: negative_data_rejection
and positive_data_acceptance (the cell protocol's dataclasses validate in pydantic's lax
mode, so e.g. `"version": false` reads as 0 there; the public bodies are strict) and
unsupported_method (Starlette's 405 lists only the first matching route's methods).
"""

from __future__ import annotations

import json
import re

import pytest

schemathesis = pytest.importorskip("schemathesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, Phase, seed, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from scheduler.api.app import create_app  # noqa: E402
from scheduler.contract.tokens import server_tokens  # noqa: E402
from tests.conftest import AUTH  # noqa: E402
from tests.scheduler.sched_fakes import make_config  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
MAX_EXAMPLES = 25
MAX_EXAMPLES_PROTOCOL = 100
"""The cell protocol has 4 operations with big bodies: more examples each."""
SEED = 1234
"""With these bounds and this seed the runs find the bugs they were written against (since
fixed): integers past 64 bits in DELETE /v1/versions/{version} and in a cell's register."""
READ_TIMEOUT_S = 20


def _dangling_refs(doc: dict) -> set[str]:
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    return refs - set(doc.get("components", {}).get("schemas", {}))


def _served_document(app) -> dict:
    r = TestClient(app, headers=AUTH).get("/openapi.json")  # no lifespan needed to serve the document
    assert r.status_code == 200
    return r.json()


def _loaded(tmp_path):
    app = create_app(make_config(), db_path=str(tmp_path / "st.sqlite"), tick_interval_s=None)
    doc = _served_document(app)
    assert not _dangling_refs(doc)  # the gateway's request models are in the components too
    schema = schemathesis.openapi.from_dict(doc)
    schema.app = app  # what from_asgi does: calls go to the app in-process
    schema.location = "/openapi.json"
    return schema


@pytest.fixture
def api_schema(tmp_path):
    return _loaded(tmp_path)


schema = schemathesis.pytest.from_fixture("api_schema")
# No shrinking: a failure is reported (with its curl reproduction) in seconds, not minutes.
FUZZ = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])


@schema.exclude(path_regex="^/internal/").parametrize()
@seed(SEED)
@settings(max_examples=MAX_EXAMPLES, **FUZZ)
def test_public_api_and_gateway(case):
    case.call_and_validate(checks=CHECKS, timeout=READ_TIMEOUT_S, headers=AUTH)


@pytest.fixture
def scope_auth(tmp_path):
    """Each scope's bootstrap token of the app `api_schema` serves (generated beside its store)."""
    sched = make_config().scheduler.model_copy(update={"db_path": str(tmp_path / "st.sqlite")})
    return {s: {"Authorization": f"Bearer {t}"} for s, t in server_tokens(sched).items()}


@schema.exclude(path_regex="^/internal/").parametrize()
@seed(SEED)
@settings(max_examples=MAX_EXAMPLES // 2, **FUZZ)
def test_public_api_and_gateway_with_an_agent_token(case, scope_auth):
    """What an agent's sandbox can reach: out of scope is a documented 403, never a 5xx."""
    case.call_and_validate(checks=CHECKS, timeout=READ_TIMEOUT_S, headers=scope_auth["agent"])


@schema.exclude(path_regex="^/internal/").parametrize()
@seed(SEED)
@settings(max_examples=MAX_EXAMPLES // 2, **FUZZ)
def test_public_api_and_gateway_with_a_trainer_token(case, scope_auth):
    case.call_and_validate(checks=CHECKS, timeout=READ_TIMEOUT_S, headers=scope_auth["trainer"])


@schema.include(path_regex="^/internal/").parametrize()
@seed(SEED)
@settings(max_examples=MAX_EXAMPLES_PROTOCOL, **FUZZ)
def test_cell_protocol(case):
    case.call_and_validate(checks=CHECKS, timeout=READ_TIMEOUT_S, headers=AUTH)


def test_served_document_refs_resolve(tmp_path):
    app = create_app(make_config(), db_path=str(tmp_path / "doc.sqlite"), tick_interval_s=None)
    assert _dangling_refs(_served_document(app)) == set()

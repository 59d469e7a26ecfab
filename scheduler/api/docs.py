"""`/docs` (Swagger UI) and `/redoc` from assets installed with cellflip (the fastapi-offline
package ships them), so the API's documentation works on a machine with no internet.

The pages, their assets and `/openapi.json` need no token (scheduler/api/scopes.py: they describe
the API and hold no data), so a browser opens them; the document declares the bearer scheme,
so Swagger UI's Authorize button sends the token on the calls it makes."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs-assets"


def install_docs(app: FastAPI) -> None:
    """Serve the docs pages and their assets locally (the app is built with docs_url=None)."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} — API",
                                   swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
                                   oauth2_redirect_url="/docs/oauth2-redirect",
                                   swagger_ui_parameters={"persistAuthorization": True})

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} — API",
                              redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False)


def declare_rules(doc: dict) -> None:
    """What the server enforces that the models alone do not say: every operation but the
    public ones needs `Authorization: Bearer <token>` of a scope its route takes (Swagger UI's
    Authorize button; each operation's description names them); every body route may answer
    400 (the body decoder) and every agent route 429 (its budget); integers are 64-bit; a
    sync's events carry one of the known types."""
    from scheduler.api.scopes import PUBLIC, ROUTE_SCOPES
    from scheduler.contract.protocol import EVENTS

    doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer",
        "description": "A token of a scope the route takes (admin takes every route): `api.token` "
                       "(admin), `trainer.token`, `cell.token`, `agent.token`, `metrics.token` beside the "
                       "store, or one made by `cellflip token create --scope S`."}
    doc["security"] = [{"bearer": []}]
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            scopes = ROUTE_SCOPES.get((method.upper(), path))
            if scopes == PUBLIC:
                op["security"] = []
            elif scopes is not None:
                op["x-cellflip-scopes"] = sorted(scopes | {"admin"})
                note = f"Token scopes: {', '.join(sorted(scopes | {'admin'}))}."
                op["description"] = f"{op.get('description', '').rstrip()}\n\n{note}".strip()
            answers = op.setdefault("responses", {})
            if "requestBody" in op:  # the one body decoder in front of every route (scheduler/api/limits.py)
                answers.setdefault("400", _error("The body is not UTF-8 text, or holds a lone UTF-16 surrogate"))
            if scopes is not None and "agent" in scopes:  # each agent token's budget (scheduler/api/auth.py)
                answers.setdefault("429", _error("The agent token's request rate or concurrent-session limit"))
    schemas = doc.get("components", {}).get("schemas", {})
    for schema in schemas.values():
        _int64(schema)
    events = schemas.get("SyncRequest", {}).get("properties", {}).get("events")
    if events is not None:
        events["items"] = {"type": "object", "required": ["type"], "additionalProperties": True,
                           "properties": {"type": {"type": "string", "enum": sorted(EVENTS)}}}


def _int64(schema: dict) -> None:
    """Integers without bounds of their own are 64-bit signed (SQLite's INTEGER; larger is a 422)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node.setdefault("minimum", -(1 << 63))
                node.setdefault("maximum", (1 << 63) - 1)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ApiError"}}}}

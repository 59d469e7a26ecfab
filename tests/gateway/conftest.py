"""Fixtures for the TITO gateway tests."""

from __future__ import annotations

import pytest
from gateway_harness import RENDERER_NAMES, LiveServer


@pytest.fixture(scope="session")
def renderers():
    from scheduler.gateway.tito.render import load_renderer

    return {name: load_renderer(name) for name in RENDERER_NAMES}


@pytest.fixture(scope="module")
def live_server_factory():
    servers: list[LiveServer] = []

    def make(app) -> LiveServer:
        s = LiveServer(app).__enter__()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.__exit__(None, None, None)

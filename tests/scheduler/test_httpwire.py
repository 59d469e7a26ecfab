"""The scheduler's HTTP protocol (scheduler/api/httpwire.py): what one event-loop step writes
leaves in one write, large bodies at once, closing passes everything on; a real uvicorn
server on it answers keep-alive requests, a streamed body and an error whole."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time

import pytest
import uvicorn

from scheduler.api.httpwire import FLUSH_BYTES, PROTOCOL, GatheredTransport, Protocol


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False
        self.paused = 0

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused += 1


def _run(fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(fn(loop))
    finally:
        loop.close()


def test_one_step_leaves_in_one_write() -> None:
    async def go(loop):
        real = FakeTransport()
        t = GatheredTransport(real, loop)
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(memoryview(b"{}"))
        t.write(b"")
        assert real.writes == []  # gathered until the step ends
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        t.write(b"next")  # control: the next step's bytes are a write of their own
        await asyncio.sleep(0)
        assert real.writes[1:] == [b"next"]
        t.pause_reading()  # everything else is the real transport's
        assert real.paused == 1
    _run(go)


def test_large_write_passes_at_once_and_close_flushes_first() -> None:
    async def go(loop):
        real = FakeTransport()
        t = GatheredTransport(real, loop)
        t.write(b"h")
        t.write(b"x" * FLUSH_BYTES)
        assert real.writes == [b"h" + b"x" * FLUSH_BYTES]  # at once: flow control acts where it did
        t.write(b"last")
        t.close()
        assert real.writes[-1] == b"last" and real.closed
        await asyncio.sleep(0)  # the step's scheduled flush finds nothing left
        assert len(real.writes) == 2
        t2 = GatheredTransport(FakeTransport(), loop)
        t2.write(b"dropped")
        t2.abort()
        await asyncio.sleep(0)
        assert t2._real.writes == [] and t2._real.aborted
    _run(go)


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    path = scope["path"]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for k in range(50):
            await send({"type": "http.response.body", "body": b"%04d" % k * 8192, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    status = 404 if path == "/missing" else 200
    out = b"echo:" + body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture()
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", http=PROTOCOL,
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield port, srv
    srv.should_exit = True
    thread.join(timeout=20)


def test_real_server_answers_whole(server) -> None:
    port, srv = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for k in range(3):  # keep-alive: each answer whole, in order
            conn.request("POST", "/echo", body=b"n=%d" % k)
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"echo:n=%d" % k)
        conn.request("GET", "/missing")
        r = conn.getresponse()
        assert (r.status, r.read()) == (404, b"echo:")
        conn.request("GET", "/stream")
        r = conn.getresponse()
        assert r.status == 200
        assert r.read() == b"".join(b"%04d" % k * 8192 for k in range(50))
        assert isinstance(next(iter(srv.server_state.connections)), Protocol)
    finally:
        conn.close()


def test_the_scheduler_serves_with_it(tmp_path, monkeypatch):
    """`python -m scheduler` and the Ray actor (by module path) name this protocol."""
    from pathlib import Path

    from scheduler.__main__ import main

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **k: runs.append(k))
    monkeypatch.chdir(tmp_path)
    assert main(["--db", str(tmp_path / "a.sqlite")]) == 0
    assert runs and runs[0]["http"] is Protocol
    actors = (Path(__file__).resolve().parents[2] / "cells" / "launch" / "actors.py").read_text()
    assert f'http="{PROTOCOL}"' in actors

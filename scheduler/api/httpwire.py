"""The scheduler's HTTP/1.1 protocol for uvicorn: httptools' with one socket write per response.

uvicorn writes a response's status line and headers when the app sends `http.response.start`
and its body at `http.response.body`: two `send()` calls for every answer, each a system call
(on the loopback it also runs the receiver's TCP path in the sender's process). `Protocol`
hands uvicorn's cycle a transport that gathers what one event-loop step writes and passes it
on in one write at the end of that step (`loop.call_soon`): a plain JSON answer leaves in one
segment, a cell's sync costs one system call fewer (bench/scale_ingest.py). Nothing waits: the
gathered bytes leave before the loop polls for I/O again, and past `FLUSH_BYTES` (a large or
streamed body) they are passed on at once, so the real transport's flow control
(`pause_writing`) acts where it did. Closing passes on what was gathered first.

Used by every server of the app: `python -m scheduler`, the Ray actor
(cells/launch/actors.py) and the benches (`--http scheduler.api.httpwire:Protocol`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

FLUSH_BYTES = 64 * 1024
"""Gathered bytes past which a write is passed on at once."""

PROTOCOL = "scheduler.api.httpwire:Protocol"
"""uvicorn's `http=` (or `--http`) for this protocol."""


class GatheredTransport:
    """A transport's stand-in: `write` gathers, one `call_soon` passes the step's bytes on;
    everything else is the real transport's."""

    __slots__ = ("_real", "_loop", "_parts", "_size")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._loop = loop
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(bytes(data))
        self._size += len(data)
        if self._size >= FLUSH_BYTES:
            self.flush()

    def writelines(self, parts: list) -> None:
        for p in parts:
            self.write(p)

    def flush(self) -> None:
        """Pass what was gathered on to the real transport (nothing if it is closing)."""
        if not self._parts:
            return
        parts, self._parts, self._size = self._parts, [], 0
        if not self._real.is_closing():
            self._real.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self._real.close()

    def write_eof(self) -> None:
        self.flush()
        self._real.write_eof()

    def abort(self) -> None:
        self._parts, self._size = [], 0
        self._real.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Protocol(HttpToolsProtocol):
    """httptools' protocol whose cycles write through a `GatheredTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(GatheredTransport(transport, self.loop))  # type: ignore[arg-type]

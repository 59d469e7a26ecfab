"""The exporter's client of the scheduler's export routes (reader scope; scheduler/api/export.py):
the stream of finished trajectories past a cursor, acks, status, and the versions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class ExportError(RuntimeError):
    """The scheduler refused or could not be reached; the message says which and why."""


class ExportSource:
    def __init__(self, url: str, token: str | None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str, **params: Any) -> dict:
        try:
            r = self.http.get(path, params={k: v for k, v in params.items() if v is not None})
        except httpx.HTTPError as e:
            raise ExportError(f"cannot reach {self.url}: {e}") from None
        _check(r, self.url)
        return r.json()

    def status(self) -> dict:
        return self._get("/v1/export/status")

    def versions(self) -> list[dict]:
        return self._get("/v1/export/versions")["versions"]

    def stream(self, after: int, job: str | None = None, until: int | None = None, packed: bool = True
               ) -> Iterator[dict[str, Any]]:
        """Rows past `after` (oldest first), then a last `{"next": cursor}` item; `packed`: the
        per-token columns as base64 arrays (cells/export/table.py reads either form)."""
        params: dict[str, Any] = {k: v for k, v in {"after": after, "job": job, "until": until}.items() if v is not None}
        params["packed"] = "true" if packed else "false"
        try:
            with self.http.stream("GET", "/v1/export/stream", params=params) as r:
                if r.status_code != 200:
                    r.read()
                    _check(r, self.url)
                for line in r.iter_lines():
                    if line:
                        yield json.loads(line)
        except httpx.HTTPError as e:
            raise ExportError(f"the stream from {self.url} broke: {e}") from None

    def ack(self, name: str, cursor: int) -> None:
        try:
            r = self.http.put("/v1/export/ack", json={"name": name, "cursor": cursor})
        except httpx.HTTPError as e:
            raise ExportError(f"cannot reach {self.url}: {e}") from None
        _check(r, self.url)


def _check(r: httpx.Response, url: str) -> None:
    if r.status_code == 200:
        return
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = r.text[:200]
    hint = " (the export needs a reader, trainer or admin token)" if r.status_code in (401, 403) else ""
    raise ExportError(f"{url} answered {r.status_code}: {detail}{hint}")

"""The cell's HTTP client for the scheduler's internal protocol (scheduler/contract/protocol.py)."""

from __future__ import annotations

import httpx

from scheduler.contract.protocol import (
    AbortMigrationRequest,
    CommitRequest,
    RegisterRequest,
    RegisterResponse,
    SyncRequest,
    SyncResponse,
)


class Fenced(RuntimeError):
    """The scheduler no longer accepts this incarnation: drop everything, register anew."""


class Refused(RuntimeError):
    """A 409 with a reason (e.g. a commit that lost its compare-and-set)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail and detail != reason else reason)
        self.reason = reason


class SchedulerClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        r = self.http.post(path, json=body, timeout=timeout or self.http.timeout)
        if r.status_code == 409 or (r.status_code == 404 and path.endswith("/register")):  # 404: an unknown job
            body = r.json()
            reason = str(body.get("reason") or body.get("detail"))
            if reason in ("fenced", "stale_incarnation"):
                raise Fenced(reason)
            raise Refused(reason, str(body.get("detail") or ""))
        if r.status_code == 404 and "/sync" in path:
            raise Fenced("unknown cell")
        r.raise_for_status()
        return r.json()

    def register(self, req: RegisterRequest) -> RegisterResponse:
        return RegisterResponse.from_dict(self._post("/internal/v1/cells/register", req.to_dict()))

    def sync(self, cell_id: str, req: SyncRequest) -> SyncResponse:
        return SyncResponse.from_dict(self._post(f"/internal/v1/cells/{cell_id}/sync", req.to_dict(),
                                                 timeout=10.0 + req.wait_s))

    def commit(self, migration_id: str, req: CommitRequest) -> int:
        return int(self._post(f"/internal/v1/migrations/{migration_id}/commit", req.to_dict())["epoch"])

    def abort_migration(self, migration_id: str, req: AbortMigrationRequest) -> None:
        self._post(f"/internal/v1/migrations/{migration_id}/abort", req.to_dict())


def all_cells(http: httpx.Client, url: str, headers: dict | None = None) -> list[dict]:
    """Every cell, following GET /v1/cells's pages (`next_cursor`) to the last."""
    cells: list[dict] = []
    params: dict[str, str] = {}
    while True:
        body = http.get(f"{url}/v1/cells", params=params, headers=headers or {}).json()
        cells += body["cells"]
        if not body.get("next_cursor"):
            return cells
        params = {"cursor": body["next_cursor"]}

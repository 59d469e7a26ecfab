"""The trainer's client of the scheduler's REST API: flips, versions, trajectories.

What an external trainer needs, and all the built-in trainer uses (so the main job exercises
the public API itself): request flips and wait for them, publish a version from a version
host, wait until a version's tokens are scored, fetch finished trajectories with their old
log-probs, retire versions. Every call has a timeout; errors carry the API's reason.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

FINISHED_FLIP_STATES = ("done", "failed", "rolled_back")


class ApiError(RuntimeError):
    def __init__(self, status: int, reason: str | None, detail: str) -> None:
        super().__init__(f"{status} {reason or ''}: {detail}".strip())
        self.status, self.reason, self.detail = status, reason, detail


_UNKNOWN = object()


class TrainerClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        """`token`: a trainer (or admin) token; None reads the trainer's as every client does
        ($CELLFLIP_TRAINER_TOKEN, else the scheduler's generated `runs/trainer.token`;
        scheduler/contract/tokens.py)."""
        from scheduler.contract.tokens import client_token

        token = token if token is not None else client_token(scope="trainer")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.cursor = 0
        """Trajectories up to this cursor have been fetched."""
        self._version_host: tuple[str, int] | None = None
        """The version host registered with the scheduler by this client."""
        self._job: str | None | object = _UNKNOWN

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kw) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = {"detail": r.text}
            raise ApiError(r.status_code, body.get("reason"), str(body.get("detail", body)))
        return r.json()

    def job_training(self) -> dict[str, Any] | None:
        """What this trainer's RL job trains with (GET /v1/jobs `trainer`: the job's `objective`
        over the configured one, its `staleness_bound`): a job-bound token's own job, else
        `default`. None when the scheduler has no jobs API or cannot be reached (the configured
        objective then applies)."""
        try:
            jobs = self._call("GET", "/v1/jobs")["jobs"]
        except httpx.TransportError:
            return None
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        mine = jobs[0] if len(jobs) == 1 else next((j for j in jobs if j["name"] == "default"), None)
        return None if mine is None else mine.get("trainer")

    # -- cells and flips ----------------------------------------------------------------------
    def cells(self) -> list[dict]:
        """Every cell of the trainer's RL job (`job`; every cell where it is None), following
        the list's pages (`next_cursor`) to the last."""
        out: list[dict] = []
        params: dict[str, str] = {}
        while True:
            body = self._call("GET", "/v1/cells", params=params)
            out += body["cells"]
            if not body.get("next_cursor"):
                break
            params = {"cursor": body["next_cursor"]}
        job = self.job()
        return out if job is None else [c for c in out if c.get("job", "default") == job]

    def job(self) -> str | None:
        """The RL job this client's token is bound to on a fleet shared by several jobs (GET
        /v1/jobs lists that job alone); None for a token bound to none, a fleet serving only
        `default`, or a scheduler without jobs. Asked once: a token's job never changes."""
        if self._job is _UNKNOWN:
            try:
                jobs = self._call("GET", "/v1/jobs")["jobs"]
            except ApiError as e:
                if e.status not in (403, 404):  # a scheduler without jobs, a token that may not list them
                    raise
                jobs = []
            self._job = jobs[0]["name"] if len(jobs) == 1 and jobs[0]["name"] != "default" else None
        return self._job

    def flip(self, to: str, *, cell: str | None = None, count: int | None = None,
             key: str | None = None) -> list[dict]:
        """Request flips (one cell, or `count` cells the planner picks); idempotent per key."""
        body: dict[str, Any] = {"to": to}
        if cell is not None:
            body["cell"] = cell
        if count is not None:
            body["count"] = count
        headers = {"Idempotency-Key": key or uuid.uuid4().hex}
        return self._call("POST", "/v1/flips", json=body, headers=headers)["flips"]

    def flips(self, active: bool = False) -> list[dict]:
        """Every flip (`active`: only those under way), whoever requested it."""
        return self._call("GET", "/v1/flips", params={"active": active})["flips"]

    def report_training(self, *, batch_size: int, steps_in_progress: int, max_cells_per_step: int,
                        step_s: float | None = None, sessions: int | None = None,
                        tokens: int | None = None, cells: int | None = None, untrained: int = 0,
                        update: dict | None = None) -> dict:
        """Declare the trainer's demand (batch size, steps running, cells a step can use, sessions
        fetched and not yet trained) and, after a step, what it took (seconds, sessions, tokens,
        cells): the planner's training side and the staleness admission rule's input."""
        body: dict[str, Any] = {"batch_size": batch_size, "steps_in_progress": steps_in_progress,
                                "max_cells_per_step": max_cells_per_step, "untrained": untrained}
        if step_s is not None:
            body |= {"step_s": step_s, "sessions": sessions, "tokens": tokens, "cells": cells}
        if update is not None:
            body["update"] = update
        return self._call("POST", "/v1/trainer/report", json=body)

    def wait_flips(self, flips: list[dict], timeout_s: float = 300.0) -> list[dict]:
        """Wait until every flip finished; returns their final records."""
        deadline, out = time.monotonic() + timeout_s, {}
        while len(out) < len(flips):
            for f in flips:
                if f["id"] not in out:
                    cur = self._call("GET", f"/v1/flips/{f['id']}")
                    if cur["state"] in FINISHED_FLIP_STATES:
                        out[f["id"]] = cur
            if len(out) < len(flips):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flips not finished after {timeout_s}s: {sorted(set(f['id'] for f in flips) - set(out))}")
                time.sleep(0.1)
        return [out[f["id"]] for f in flips]

    # -- versions -----------------------------------------------------------------------------
    def register_version_host(self, host: str, port: int) -> dict:
        """Declare where this trainer serves versions: the scheduler sends cells to no other
        address (besides live cells)."""
        out = self._call("PUT", "/v1/trainer/version-host", json={"host": host, "port": port})
        self._version_host = (host, port)
        return out

    def publish(self, version: int, host: str, port: int, namespace: str = "versions",
                key: str | None = None) -> dict:
        """Record `version` and tell the rollout cells to join its broadcast; the answer's
        `receivers` are the cells to broadcast to. Idempotent per key. Registers the version
        host first when it is a new one."""
        if self._version_host != (host, port):
            self.register_version_host(host, port)
        return self._call("POST", "/v1/versions", json={
            "version": version, "source": {"host": host, "port": port, "namespace": namespace}},
            headers={"Idempotency-Key": key or uuid.uuid4().hex})

    def export(self, version: int, path: str, dtype: str = "float32") -> dict:
        """Ask a cell holding `version` to write it as a Hugging Face directory at `path`
        (below its `cells.export_root`); the answer names the export to follow."""
        return self._call("POST", f"/v1/versions/{version}/exports", json={"path": path, "dtype": dtype})

    def export_state(self, export_id: str) -> dict:
        return self._call("GET", f"/v1/exports/{export_id}")

    def versions(self) -> dict:
        return self._call("GET", "/v1/versions")

    def version(self, v: int) -> dict | None:
        return next((x for x in self.versions()["versions"] if x["version"] == v), None)

    def wait_active(self, v: int, timeout_s: float = 300.0) -> dict:
        return self._wait(lambda: (x := self.version(v)) is not None and x["state"] in ("active", "retiring", "retired")
                          and x, timeout_s, f"version {v} active")

    def retire(self, v: int) -> dict:
        return self._call("DELETE", f"/v1/versions/{v}")

    # -- trajectories -------------------------------------------------------------------------
    def trajectories(self, limit: int = 64) -> list[dict]:
        """Finished sessions after the cursor (oldest first); advances the cursor."""
        body = self._call("GET", "/v1/trajectories", params={"cursor": self.cursor, "limit": limit})
        self.cursor = body["next_cursor"]
        return body["trajectories"]

    def report_dropped(self, reason: str, groups: int, trajectories: int) -> dict:
        """Count groups the trainer dropped (never trained) in the scheduler's
        `cellflip_groups_dropped_total{reason}`."""
        return self._call("POST", "/v1/trajectories/dropped",
                          json={"reason": reason, "groups": groups, "trajectories": trajectories})

    def session(self, session_id: str) -> dict:
        return self._call("GET", f"/v1/sessions/{session_id}")

    def wait_scored(self, trajectories: list[dict], timeout_s: float = 300.0) -> list[dict]:
        """Re-read trajectories until every sampled token has an old log-prob (exact or
        missing): what the decoupled objective needs. Returns the fresh copies."""
        fresh = {t["id"]: t for t in trajectories}

        def done() -> bool:
            for sid, t in list(fresh.items()):
                if any(m and p is None for m, p in zip(t["loss_mask"], t["provenance"], strict=True)):
                    fresh[sid] = self.session(sid)
            return all(not any(m and p is None for m, p in zip(t["loss_mask"], t["provenance"], strict=True))
                       for t in fresh.values())

        self._wait(done, timeout_s, "old log-probs of the batch")
        return [fresh[t["id"]] for t in trajectories]

    @staticmethod
    def _wait(pred, timeout_s: float, what: str, every: float = 0.2):
        deadline = time.monotonic() + timeout_s
        while True:
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(every)

"""Weight versions: broadcasting → active → retiring → retired.

The trainer publishes an integer version (broadcasting); it becomes active once every live
rollout cell reports serving it (older active versions then start retiring). A version is
retired only on request and only when no live cell serves it and every token sampled under it
has an old log-prob (exact, or counted as missing) — otherwise 409, so a version is never
dropped while the log-prob service still needs it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from scheduler.errors import Conflict, NotFound
from scheduler.states import VERSION, set_state
from scheduler.store_fleet import VersionRow

if TYPE_CHECKING:
    from scheduler.controller import Controller


def current_version(ctl: Controller) -> int | None:
    """The newest active version (what a loading cell must serve)."""
    active = [v.v for v in ctl.store.fleet.list_versions() if v.state == "active"]
    return max(active) if active else None


def serving(ctl: Controller) -> dict[int, list[str]]:
    """version → live cells serving it (as last reported)."""
    out: dict[int, list[str]] = {}
    for c in ctl.store.fleet.list_cells():
        entry = ctl.registry.live.get(c.id)
        if c.state == "down" or entry is None:
            continue
        v = entry.summary.version if entry.summary is not None else c.version
        if v is not None:
            out.setdefault(v, []).append(c.id)
    return out


def publish(ctl: Controller, version: int) -> dict[str, Any]:
    with ctl.txn(durable=True):
        rows = ctl.store.fleet.list_versions()
        if any(r.v == version for r in rows):
            raise Conflict(f"version {version} exists", reason="version_exists")
        if rows and version < max(r.v for r in rows):
            raise Conflict(f"version {version} is older than {max(r.v for r in rows)}", reason="version_not_newer")
        row = VersionRow(version, "broadcasting", time.time(), [("broadcasting", time.time(), "published")])
        ctl.store.fleet.put_version(row)
    ctl.kick()
    return _to_api(ctl, row, {}, serving(ctl))


def progress(ctl: Controller) -> None:
    """Passive: activate broadcast versions that every live rollout cell serves."""
    rows = ctl.store.fleet.list_versions()
    pending = [r for r in rows if r.state == "broadcasting"]
    if not pending:
        return
    rollout_versions = []
    for c in ctl.store.fleet.list_cells():
        entry = ctl.registry.live.get(c.id)
        if c.state == "rollout" and entry is not None and entry.seen:
            rollout_versions.append(entry.summary.version if entry.summary else c.version)
    for row in sorted(pending, key=lambda r: r.v):
        if any(v != row.v for v in rollout_versions):
            continue
        with ctl.txn(durable=True):
            set_state(VERSION, row, "active", "every rollout cell serves it")
            ctl.store.fleet.put_version(row)
            for old in rows:
                if old.v < row.v and old.state == "active":
                    set_state(VERSION, old, "retiring", f"version {row.v} active")
                    ctl.store.fleet.put_version(old)


def retire(ctl: Controller, version: int) -> dict[str, Any]:
    with ctl.txn(durable=True):
        row = ctl.store.fleet.get_version(version)
        if row is None:
            raise NotFound(f"unknown version {version}")
        if row.state != "retired":
            VERSION.check(row.state, "retired")
            cells = serving(ctl).get(version, [])
            if cells:
                raise Conflict(f"version {version} is still served by {sorted(cells)}", reason="version_in_use")
            unscored = ctl.store.sessions.unscored(version)
            if unscored:
                raise Conflict(f"{unscored} tokens of version {version} have no old log-prob yet",
                               reason="unscored_tokens")
            set_state(VERSION, row, "retired", "retired on request")
            ctl.store.fleet.put_version(row)
    return _to_api(ctl, row, ctl.store.sessions.version_counts(), serving(ctl))


def list_all(ctl: Controller) -> list[dict[str, Any]]:
    counts, cells = ctl.store.sessions.version_counts(), serving(ctl)
    return [_to_api(ctl, r, counts, cells) for r in ctl.store.fleet.list_versions()]


def _to_api(ctl: Controller, row: VersionRow, counts: dict, cells: dict) -> dict[str, Any]:
    c = counts.get(row.v, {})
    return {
        "version": row.v, "state": row.state, "cells": sorted(cells.get(row.v, [])),
        "tokens_generated": c.get("generated", 0), "tokens_scored": c.get("exact", 0),
        "tokens_missing": c.get("missing", 0), "tokens_unscored": c.get("unscored", 0),
        "history": [list(h) for h in row.history],
    }

"""Versions from the trainer's side: it names what to publish and where, a cell that computed
the version does the rest (cells/training/holder.py: keeps it, broadcasts it, serves its
catch-ups); exports are asked of a cell holding the version (POST /v1/versions/{v}/exports)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cells.training import jobs


def publish(t: Any) -> None:
    """Publish the committed version from a cell that computed it: it keeps the weights in
    its version host (checked against the commit's checksum), the scheduler names the
    receivers, the cell broadcasts to them and serves the catch-ups."""
    t0 = time.monotonic()
    version, store = t.version, t.coordinator.store
    known = {v["version"] for v in t.client.versions()["versions"]}
    if version in known:
        return
    cell = t.coordinator.publisher()
    live = [v["version"] for v in t.client.versions()["versions"] if v["state"] != "retired"]
    put = jobs.wait(store, jobs.post(store, cell, {"op": "put", "version": version, "live": live,
                                                   "bucket_bytes": t.cfg.versions.bucket_bytes,
                                                   "update_backend": t.cfg.versions.update_backend}), 120.0)
    if not put.get("ok"):
        raise RuntimeError(f"cell {cell} could not hold version {version} for publishing: {put.get('error')}")
    t.publishers.add(cell)
    a = t.store.address
    r = t.client.publish(version, a.host, a.port, put["namespace"])
    res = jobs.wait(store, jobs.post(store, cell, {"op": "broadcast", "version": version,
                                                   "receivers": r["receivers"],
                                                   "receiver_ranks": r.get("receiver_ranks", {})}), 600.0)
    t._emit({"event": "published", "version": version, "receivers": len(r["receivers"]),
             "delivered": len(res.get("delivered", [])), "failed": sorted(res.get("failed", {})),
             "root": res.get("root"), "cell": cell, "seconds": round(time.monotonic() - t0, 2)})
    if t.tc.export_every and version % t.tc.export_every == 0:
        export(t, version)


def export(t: Any, version: int, wait_s: float = 30.0) -> None:
    """Ask a cell holding `version` to write it as a Hugging Face directory (off its loop). Just
    published, no cell may report holding it yet: asked again until one does (`wait_s`)."""
    path = str(Path(t.tc.export_dir) / f"v{version}")
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                ex = t.client.export(version, path, t.tc.export_dtype)
                break
            except Exception as e:
                if getattr(e, "reason", None) != "version_not_held" or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        t._exports.append(ex["id"])
        t._emit({"event": "export", "version": version, "path": path, "id": ex["id"], "cell": ex.get("cell")})
    except Exception as e:
        t._emit({"event": "export_failed", "version": version, "path": path, "reason": str(e)[:300]})


def finish_exports(t: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    for eid in t._exports:
        while time.monotonic() < deadline:
            ex = t.client.export_state(eid)
            if ex["state"] not in ("pending", "writing"):
                t._emit({"event": "exported", "id": eid, "state": ex["state"], "path": ex.get("path")})
                break
            time.sleep(0.2)
    t._exports = []


def drop_retired(t: Any) -> None:
    """The publishing cells drop the versions the scheduler retired."""
    live = [v["version"] for v in t.client.versions()["versions"] if v["state"] != "retired"]
    if live == getattr(t, "_live", None):
        return
    t._live = live
    for cell in sorted(t.publishers):
        jobs.post(t.coordinator.store, cell, {"op": "drop", "live": live})

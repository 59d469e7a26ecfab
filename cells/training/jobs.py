"""Jobs for a cell's holder of the committed training state, on the coordinator's store: a
numbered queue per cell (`train/job/<cell>/<n>`, the number from an atomic counter in the
store, so a restarted coordinator and a peer rank share one sequence), each answered under its
own key. JSON only."""

from __future__ import annotations

from cells.transport.store import get_json, set_json, wait_json

NAMESPACE = "train/job"


def post(store, cell_id: str, job: dict) -> str:
    """Queue `job` for `cell_id`'s holder; returns the id `wait` takes."""
    n = store.add(f"{NAMESPACE}/{cell_id}/count", 1)
    jid = f"{cell_id}/{n}"
    set_json(store, f"{NAMESPACE}/{jid}", {**job, "id": jid})
    return jid


def next_job(store, cell_id: str, n: int) -> dict | None:
    """Job number `n` of `cell_id`, if it was posted."""
    key = f"{NAMESPACE}/{cell_id}/{n}"
    return get_json(store, key) if store.check([key]) else None


def posted(store, cell_id: str) -> int:
    """How many jobs were ever posted to `cell_id` on this store."""
    return int(store.add(f"{NAMESPACE}/{cell_id}/count", 0))


def answer(store, jid: str, result: dict) -> None:
    set_json(store, f"{NAMESPACE}/{jid}/answer", result)


def wait(store, jid: str, timeout_s: float) -> dict:
    r = wait_json(store, f"{NAMESPACE}/{jid}/answer", timeout_s)
    return r if r is not None else {"ok": False, "error": f"no answer to job {jid} within {timeout_s}s"}

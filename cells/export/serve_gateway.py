"""`cellflip replay DIR --serve` through a gateway: inside the replay process, a throwaway
scheduler (its store in a temporary directory, `scheduler.store.replay_request_ids` on) and one
embedded cell holding a version's weights from `DIR/weights/v<N>` in batch-invariant mode; each
recorded turn goes through `POST /v1/generate` (the token-in/token-out path) under its own
request id (`X-Request-Id`) and recorded sampling params, its seed among them (the noise of
token t is a function of seed, request id and t), and comes back compared token for token
with the recorded completion. One scheduler and cell per version the rows sample at, started
and stopped here (cells/localcluster.py: bounded waits, only its own processes, SIGTERM then
SIGKILL); a turn is its own session (its context is the recorded one: `token_ids[prompt_start:
base]`). Sessions a forward at one version cannot rebuild (`turns.apart`: moved by re-prefill,
spanning versions) are counted apart, as on the direct path (serve.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from cells.export.turns import Versions, apart, moved_by_reprefill

REQUEST_TIMEOUT_S = 120.0
"""Longest one replayed turn may take."""
READY_TIMEOUT_S = 180.0
"""Longest the throwaway scheduler and its cell may take to come up (the cell loads the weights)."""


def _config(tmp: Path, weights: Path, tile: int | None, ctx: int) -> dict[str, Any]:
    return {
        "scheduler": {"db_path": str(tmp / "replay.sqlite"), "lease_s": 5.0, "heartbeat_s": 0.2,
                      "min_rollout_cells": 1, "drain_deadline_s": 20.0, "auto_flip": False,
                      "store": {"replay_request_ids": True}},
        "cells": {"count": 1, "engine": {"type": "embedded", "model": {"preset": None, "path": str(weights)},
                                         "num_blocks": max(256, 4 * ctx // 8 + 64), "block_size": 8,
                                         "batch_invariant": True, "row_tile": tile or 1}},
    }


def _plan(rows: list[dict[str, Any]], have: set[int]) -> tuple[dict[int, list], dict[int, bool], int]:
    """Per version, the turns to send (row index, turn); per row, whether it is set apart; and
    how many rows name a version with no weights here (not replayed)."""
    todo: dict[int, list] = {}
    moved: dict[int, bool] = {}
    missing = 0
    for i, row in enumerate(rows):
        mine, m = [], moved_by_reprefill(row)
        for t in row.get("turns") or []:
            base, n = t["base"], t["num_generated"]
            if not n:
                continue
            vs = {row["version"][k] for k in range(base, base + n) if row["loss_mask"][k]}
            m = m or apart(row, t["prompt_start"], base, vs)
            v = min(x for x in vs if x is not None) if vs - {None} else None
            if v is None or v not in have:
                mine = None
                break
            mine.append((v, i, t))
        if mine is None:
            missing += 1
            continue
        moved[i] = m
        for v, i_, t in mine:
            todo.setdefault(v, []).append((i_, t))
    return todo, moved, missing


def _send(http: Any, row: dict[str, Any], t: dict[str, Any]) -> bool:
    """One recorded turn through the gateway under its own id and params: token-identical?"""
    base, n = t["base"], t["num_generated"]
    params = t["params"] if isinstance(t["params"], dict) else json.loads(t["params"] or "{}")
    body = {**params, "max_tokens": n, "prompt_ids": row["token_ids"][t["prompt_start"]:base], "stream": False}
    sid = f"replay-{t['request_id']}"
    r = http.post("/v1/generate", json=body, timeout=REQUEST_TIMEOUT_S,
                  headers={"X-Request-Id": t["request_id"], "X-Session-Id": sid})
    if r.status_code != 200:
        raise RuntimeError(f"the replay's gateway refused turn {t['request_id']}: {r.status_code} {r.text[:300]}")
    http.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.0}, timeout=REQUEST_TIMEOUT_S)
    return r.json()["token_ids"] == row["token_ids"][base:base + n]


def _serve_version(root: Path, v: int, turns: list, rows: list[dict[str, Any]], tile: int | None,
                   ok: dict[int, bool]) -> None:
    from cells.localcluster import Cluster

    ctx = max(len(rows[i]["token_ids"]) for i, _ in turns)
    with tempfile.TemporaryDirectory(prefix="cellflip-replay-") as tmp:
        cfg = _config(Path(tmp), root / "weights" / f"v{v}", tile, ctx)
        c = Cluster(Path(tmp), num_cells=1, cfg=cfg, ready_timeout_s=READY_TIMEOUT_S)
        try:
            for i, t in turns:
                ok[i] = _send(c.http, rows[i], t) and ok.get(i, True)
        except Exception as e:
            raise RuntimeError(f"{e}\n{c.logs()[-2000:]}") from None
        finally:
            c.stop()


def replay_serve_gateway(root: Path, rows: list[dict[str, Any]], tile: int | None) -> dict[str, Any]:
    root = Path(root)
    todo, moved, missing = _plan(rows, set(Versions(root, tile).available()))
    ok: dict[int, bool] = {}
    for v in sorted(todo):
        _serve_version(root, v, todo[v], rows, tile, ok)
    kept = [i for i in moved if not moved[i]]
    apart_ = [i for i in moved if moved[i]]
    return {"replay_serve_path": "gateway",
            "replay_serve_sessions": len(kept),
            "replay_serve_identical_frac": sum(ok.get(i, True) for i in kept) / len(kept) if kept else None,
            "replay_serve_moved_sessions": len(apart_),
            "replay_serve_moved_identical_frac": sum(ok.get(i, True) for i in apart_) / len(apart_) if apart_
            else None,
            "replay_serve_no_weights": missing}

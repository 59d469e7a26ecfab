"""`cellflip replay DIR --serve-direct` (the gateway path is serve_gateway.py): each turn's prompt sampled again on an embedded engine in
batch-invariant mode holding the turn's version, under the request's own id and sampling
params (its seed among them: the noise of token t is a function of seed, request id and t), and
compared token for token with the recorded completion. A session is identical when all its
turns are; sessions with a turn `replay.apart` names are counted apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cells.export.turns import Versions, apart, moved_by_reprefill


def _engine(vers: Versions, v: int, tile: int | None, blocks: int):
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.contract.config.engine import EmbeddedEngineConfig

    w = vers.tensors(v)
    cfg = EmbeddedEngineConfig(batch_invariant=True, row_tile=tile or 1, num_blocks=blocks)
    return EmbeddedEngine(cfg, spec=vers.spec, weights=w, version=v)


def _sample(engine: Any, rid: str, prompt: list[int], params: dict[str, Any], n: int) -> list[int]:
    from cells.engine.records import SamplingParams

    p = SamplingParams.model_validate({**params, "max_tokens": n})
    engine.add_request(rid, prompt, p)
    out: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            if ev.request_id == rid:
                out.append(ev.record.token_id)
    return out


def replay_serve(root: Path, rows: list[dict[str, Any]], tile: int | None) -> dict[str, Any]:
    vers = Versions(Path(root), tile)
    have = set(vers.available())
    engines: dict[int, Any] = {}
    tally = {"kept": [0, 0], "moved": [0, 0], "no_weights": 0}
    for row in rows:
        ok, moved, skipped = True, moved_by_reprefill(row), False
        for t in row.get("turns") or []:
            base, n = t["base"], t["num_generated"]
            if not n:
                continue
            vs = {row["version"][i] for i in range(base, base + n) if row["loss_mask"][i]}
            moved = moved or apart(row, t["prompt_start"], base, vs)
            v = min(x for x in vs if x is not None) if vs - {None} else None
            if v is None or v not in have:
                skipped = True
                break
            if v not in engines:
                ctx = max(len(r["token_ids"]) for r in rows)
                engines[v] = _engine(vers, v, tile, blocks=max(256, 4 * ctx // 8 + 64))
            params = t["params"] if isinstance(t["params"], dict) else json.loads(t["params"] or "{}")
            got = _sample(engines[v], t["request_id"], row["token_ids"][t["prompt_start"]:base], params, n)
            ok = ok and got == row["token_ids"][base:base + n]
        if skipped:
            tally["no_weights"] += 1
            continue
        key = "moved" if moved else "kept"
        tally[key][0] += 1
        tally[key][1] += ok
    k, m = tally["kept"], tally["moved"]
    return {"replay_serve_path": "direct", "replay_serve_sessions": k[0], "replay_serve_identical_frac": k[1] / k[0] if k[0] else None,
            "replay_serve_moved_sessions": m[0], "replay_serve_moved_identical_frac": m[1] / m[0] if m[0] else None,
            "replay_serve_no_weights": tally["no_weights"]}

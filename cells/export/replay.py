"""`cellflip replay DIR`: an export directory re-scored (and with `serve`, re-sampled) from the
directory alone, in a process with no store and no scheduler.

    rows + weights/v<N> (Hugging Face directories) → per turn, the request's context
    [prompt_start, base + num_generated) scored by a cache-free forward at each sampled token's
    version in batch-invariant mode (the log-prob service's numerics) → every behaviour and
    every exact old log-prob compared bit for bit, per version

Negative control: the same tokens scored with the weights of another version (or, with one
version only, a copy with one weight nudged) must not match. `serve`: each turn's prompt is
sampled again on an embedded engine holding the turn's version, with the request's own id and
seed (sampling noise is a function of seed, request id and position), and the session counts
as identical when every turn's tokens are. Turns `apart` says a forward cannot rebuild (moved
by re-prefill, tokens spanning versions, a context sampled under an older version whose KV an
update in flight kept) are reported apart (`moved_*`); their old log-probs are compared all the
same.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from cells.export.turns import Versions, apart
from cells.export.writer import read_rows

PROMPT_ONLY = -1


def _turns(row: dict[str, Any]) -> list[tuple[int, int, int, float]]:
    """(context start, first generated, end, temperature) per turn that generated tokens."""
    out = []
    for t in row.get("turns") or []:
        params = t["params"] if isinstance(t["params"], dict) else json.loads(t["params"] or "{}")
        if t["num_generated"]:
            out.append((t["prompt_start"], t["base"], t["base"] + t["num_generated"],
                        float(params.get("temperature", 1.0))))
    return out


def _f32(x: float | None) -> float | None:
    return None if x is None else float(torch.tensor(x, dtype=torch.float32))


def score_turn(prep: Any, ids: list[int], lo: int, base: int, end: int, temperature: float, tile: int | None
               ) -> list[float]:
    """Log-probs of tokens [base, end) given the context from `lo` (float32 values as floats)."""
    from cells.engine.embedded.model import token_logprobs

    with torch.no_grad():
        lp = token_logprobs(prep, torch.tensor(ids[lo:end]), temperature, tile)
    return lp[base - lo - 1:].tolist()


def replay_scores(root: Path, rows: list[dict[str, Any]], tile: int | None) -> dict[str, Any]:
    """Per version: sampled tokens compared, behaviour and old log-probs equal bit for bit, and
    the negative control's matches (which must be none)."""
    vers = Versions(root, tile)
    have = vers.available()
    per: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        for lo, base, end, temp in _turns(row):
            vs = {row["version"][i] for i in range(base, end) if row["loss_mask"][i]}
            moved = apart(row, lo, base, vs)
            for v in sorted(x for x in vs if x is not None):
                if v not in have:
                    per[v]["no_weights"] += end - base
                    continue
                lp = score_turn(vers.prepared(v), row["token_ids"], lo, base, end, temp, tile)
                wrong = [x for x in have if x != v]
                ctl = score_turn(vers.prepared(wrong[0]) if wrong else vers.prepared(v, nudge=True),
                                 row["token_ids"], lo, base, end, temp, tile)
                _tally(per[v], row, base, end, v, lp, ctl, moved)
    return {str(v): _fractions(d) for v, d in sorted(per.items())}


def _tally(d: dict[str, int], row: dict[str, Any], base: int, end: int, v: int, lp: list[float], ctl: list[float],
           apart: bool) -> None:
    for i in range(base, end):
        if not row["loss_mask"][i] or row["version"][i] != v:
            continue
        got, wrong = _f32(lp[i - base]), _f32(ctl[i - base])
        key = "moved" if apart else "kept"
        d[f"{key}_tokens"] += 1
        d[f"{key}_behaviour_exact"] += got == _f32(row["logprob"][i])
        if row["old_provenance"][i] == 1:
            d["old_tokens"] += 1
            d["old_exact"] += got == _f32(row["old_logprob"][i])
        d["control_tokens"] += 1
        d["control_matches"] += wrong == _f32(row["logprob"][i])


def _fractions(d: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = dict(d)
    exact = d.get("kept_behaviour_exact", 0) + d.get("old_exact", 0)
    total = d.get("kept_tokens", 0) + d.get("old_tokens", 0)
    out["replay_exact_frac"] = exact / total if total else None
    out["moved_behaviour_exact_frac"] = (d["moved_behaviour_exact"] / d["moved_tokens"]) if d.get("moved_tokens") \
        else None
    out["control_match_frac"] = d["control_matches"] / d["control_tokens"] if d.get("control_tokens") else None
    return out


def replay(root: str | Path, tile: int | None = 4, serve: str | None = None) -> dict[str, Any]:
    """The replay report of an export directory (`replay_exact_frac` per version, overall, and
    with `serve` the token-identical fraction of sessions: `gateway` through a throwaway
    scheduler's gateway and cell (serve_gateway.py), `direct` on an in-process engine (serve.py))."""
    root = Path(root)
    rows = read_rows(root)
    per = replay_scores(root, rows, tile)
    exact = sum(d.get("kept_behaviour_exact", 0) + d.get("old_exact", 0) for d in per.values())
    total = sum(d.get("kept_tokens", 0) + d.get("old_tokens", 0) for d in per.values())
    ctl = sum(d.get("control_matches", 0) for d in per.values())
    out: dict[str, Any] = {"sessions": len(rows), "versions": per, "replay_exact_frac": exact / total if total else None,
                           "control_match_frac": ctl / max(1, sum(d.get("control_tokens", 0) for d in per.values())),
                           "no_weights_tokens": sum(d.get("no_weights", 0) for d in per.values())}
    if serve == "gateway":
        from cells.export.serve_gateway import replay_serve_gateway

        out.update(replay_serve_gateway(root, rows, tile))
    elif serve == "direct":
        from cells.export.serve import replay_serve

        out.update(replay_serve(root, rows, tile))
    elif serve is not None:
        raise ValueError(f"serve must be 'gateway' or 'direct', not {serve!r}")
    return out

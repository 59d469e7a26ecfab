"""The trainer's write-back of what training did with each trajectory (POST
/v1/trajectories/outcomes; the export's `train_*` columns, and what retention waits for).

    trained   status `trained` (or `rejected`: the guard rolled the update back), the version
              the update published, the RL step, the version it started from, the session's
              advantage (recomputed by the same pure plan the coordinator split the update
              with: cells/rl/plan.py) and its staleness (versions between its oldest sampled
              token and the update's start), its train/inference ratios (`correction`) and the
              per-token weights the update multiplied its objective by (`weights`: the training
              ranks' cells/rl/used_weights.py, through the coordinator; base64 float32 of its
              loss-mask tokens, at most `MAX_WEIGHT_TOKENS`, else `weights_omitted`)
    dropped   status `dropped` and the reason the group gate gave (cells/trainer/groups.py)

A write-back that fails is logged and training goes on (the rows then have no outcome, and
retention keeps them).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from scheduler.contract.trajexport import MAX_WEIGHT_TOKENS, OUTCOME_POST_BYTES

log = logging.getLogger("cellflip.trainer")

CHUNK = 1024
"""Most sessions per POST (the route takes at most 4096); fewer when their bytes pass
`OUTCOME_POST_BYTES`."""


def chunks(outcomes: dict[str, dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """The outcomes in POST bodies of at most `CHUNK` sessions and `OUTCOME_POST_BYTES` bytes
    (a single session over it goes alone: its weights are bounded by `MAX_WEIGHT_TOKENS`)."""
    out: list[dict[str, dict[str, Any]]] = [{}]
    size = 0
    for sid, o in outcomes.items():
        n = len(json.dumps(o)) + len(sid) + 8
        if out[-1] and (len(out[-1]) >= CHUNK or size + n > OUTCOME_POST_BYTES):
            out.append({})
            size = 0
        out[-1][sid] = o
        size += n
    return [c for c in out if c]


def _post(t: Any, outcomes: dict[str, dict[str, Any]]) -> None:
    try:
        for part in chunks(outcomes):
            t.client._call("POST", "/v1/trajectories/outcomes", json={"outcomes": part})
    except Exception as e:  # training goes on; these rows keep no outcome
        log.warning("could not write back %d trajectory outcomes: %s", len(outcomes), e)


def advantages(t: Any, batch: list[dict], start_version: int, bound: int | None) -> dict[str, float]:
    """Each session's task advantage as the update's plan computed it (empty if it cannot)."""
    from cells.rl.plan import plan_update

    try:
        plan = plan_update(batch, t.coordinator.objective, 1, [1.0], version=start_version, staleness_bound=bound)
    except ValueError:
        return {}
    return {tr["id"]: a for s in plan.shares for tr, a in zip(s.trajectories, s.advantages)}


def correction(tr: dict) -> dict[str, Any] | None:
    """The session's train/inference ratios r_d = exp(lp_old − lp_behav) over its sampled tokens
    with an exact old log-prob (min, mean, max; before the objective's correction and the
    staleness weight, which the training cells compute per token), and its missing count."""
    import math

    r, missing = [], 0
    n = len(tr["loss_mask"])
    for m, lp, old, prov in zip(tr["loss_mask"], tr.get("logprobs") or [None] * n, tr.get("old_logprobs") or [None] * n,
                                tr.get("provenance") or [None] * n):
        if m and prov == "exact" and lp is not None and old is not None:
            r.append(math.exp(max(-20.0, min(20.0, old - lp))))
        elif m:
            missing += 1
    if not r:
        return None
    return {"r_d_min": min(r), "r_d_mean": sum(r) / len(r), "r_d_max": max(r), "tokens": len(r), "missing": missing}


def trained(t: Any, batch: list[dict], metrics: dict[str, Any], start_version: int, bound: int | None) -> None:
    try:
        out = _trained(t, batch, metrics, start_version, bound)
    except Exception as e:  # a record it cannot read: training goes on, the rows keep no outcome
        log.warning("could not build trajectory outcomes: %s", e)
        return
    _post(t, out)


def _trained(t: Any, batch: list[dict], metrics: dict[str, Any], start_version: int, bound: int | None
             ) -> dict[str, dict[str, Any]]:
    adv = advantages(t, batch, start_version, bound)
    rejected = bool(metrics.get("update_rejected"))
    used = getattr(t.coordinator, "used_weights", None) or {}
    out = {}
    for tr in batch:
        sampled = [v for m, v in zip(tr["loss_mask"], tr["versions"]) if m and v is not None]
        out[tr["id"]] = {"status": "rejected" if rejected else "trained",
                         "update_version": None if rejected else t.version, "rl_step": t.rl_step,
                         "start_version": start_version, "advantage": adv.get(tr["id"]),
                         "staleness": start_version - min(sampled) if sampled else 0, "correction": correction(tr),
                         **_weights(used.get(tr["id"]), sum(1 for m in tr["loss_mask"] if m))}
    return out


def _weights(text: str | None, masked: int) -> dict[str, Any]:
    """The session's per-token weights for its outcome, if the ranks sent them and they fit;
    else why not (`weights_missing`: no rank sent any; `weights_omitted`: too many)."""
    if text is None:
        return {"weights_missing": masked}
    return {"weights": text} if masked <= MAX_WEIGHT_TOKENS else {"weights_omitted": masked}


def dropped(t: Any, by_reason: dict[str, list[dict]]) -> None:
    out = {tr["id"]: {"status": "dropped", "drop_reason": reason}
           for reason, trs in by_reason.items() for tr in trs if isinstance(tr, dict) and tr.get("id")}
    if out:
        _post(t, out)

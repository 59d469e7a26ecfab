"""Which RL job's weights sampled each token, found by re-scoring and not from any label a cell
wrote: every sampled token of a sample of each job's trajectories is scored under every
published version of every job (the embedded engine's scoring path, batch-invariant, the
cells' row tile), and the recorded log-prob is compared with each.

A token's job is the job owning the session it belongs to (the store's `job_of`). Its error
under a job is the smallest |recorded - scored| over that job's versions. The token is
- `own`: its job's weights reproduce it (error <= `tol`);
- `foreign`: another job's weights reproduce it (error <= `tol`) and its own do not: it was
  sampled under another job's weights;
- `unmatched`: no job's weights reproduce it (reported; neither own nor foreign): e.g. a token
  decoded after its cell activated a new version mid-request under `inflight_policy: keep_kv`
  (the earlier positions' KV is the old version's, so no single version re-scores it exactly;
  a fleet checked this way runs `recompute`). Being merely closer to another job's weights than
  to its own, by a noise of 1e-5 to 1e-2, is no evidence: such a token is unmatched too.
- `shared` (within `own`): another job's weights reproduce it as well, e.g. a token sampled
  under the one warmed checkpoint every job starts from.

Cost: versions x sampled trajectories forward passes of one segment each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TOL = 1e-5
"""Batch-invariant re-scoring reproduces a recorded log-prob exactly; this is far below the
difference between two jobs' weights after one update."""


def segment_scores(engine: Any, traj: Mapping[str, Any], version: int, temperature: float) -> dict[int, float]:
    """Log-prob of every sampled token of `traj` under the engine's `version`, by position."""
    n = len(traj["token_ids"])
    starts = list(traj.get("segment_starts") or [0]) + [n]
    out: dict[int, float] = {}
    for a, b in zip(starts, starts[1:]):
        sampled = [i for i in range(max(a, 1), b) if traj["loss_mask"][i]]
        if not sampled:
            continue
        lp = engine.score(list(traj["token_ids"][a:b]), temperature=temperature, version=version).tolist()
        for i in sampled:
            out[i] = float(lp[i - a - 1])
    return out


def best_errors(trajs: Sequence[Mapping[str, Any]], weights: Mapping[str, Mapping[int, Any]], spec: Any, *,
                row_tile: int, temperature: float = 1.0) -> dict[tuple[str, int], dict[str, float]]:
    """For each sampled token (session id, position): the smallest error under each job."""
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.contract.config.engine import EmbeddedEngineConfig

    versions = [(job, v) for job, vs in weights.items() for v in sorted(vs)]
    if not versions:
        raise ValueError("no job has a version to score under")
    cfg = EmbeddedEngineConfig(batch_invariant=True, row_tile=row_tile, num_blocks=256, prefill_chunk=8192)
    job0, v0 = versions[0]
    engine = EmbeddedEngine(cfg, spec=spec, weights=weights[job0][v0], version=v0)
    best: dict[tuple[str, int], dict[str, float]] = {}
    for job, v in versions:
        engine.load_weights(v, weights[job][v])
        for t in trajs:
            for i, lp in segment_scores(engine, t, v, temperature).items():
                err = abs(float(t["logprobs"][i]) - lp)
                row = best.setdefault((t["id"], i), {})
                row[job] = min(err, row.get(job, float("inf")))
    return best


def attribute(trajs: Sequence[Mapping[str, Any]], job_of: Mapping[str, str],
              weights: Mapping[str, Mapping[int, Any]], spec: Any, *, row_tile: int, temperature: float = 1.0,
              tol: float = TOL) -> dict[str, Any]:
    """Counts of `own`, `shared`, `foreign` and `unmatched` tokens over `trajs` (`job_of`: each
    trajectory id's job; `weights`: each job's versions' weights), and the foreign ones."""
    best = best_errors(trajs, weights, spec, row_tile=row_tile, temperature=temperature)
    out: dict[str, Any] = {"checked": 0, "own": 0, "shared": 0, "foreign": 0, "unmatched": 0, "foreign_tokens": [],
                           "versions": sum(len(v) for v in weights.values())}
    for (sid, i), errs in sorted(best.items()):
        job = job_of[sid]
        own = errs.get(job, float("inf"))
        other = min((e for j, e in errs.items() if j != job), default=float("inf"))
        out["checked"] += 1
        if other <= tol < own:
            out["foreign"] += 1
            out["foreign_tokens"].append({"session": sid, "position": i, "job": job,
                                          "own_error": own, "other_error": other})
        elif own <= tol:
            out["own"] += 1
            out["shared"] += int(other <= tol)
        else:
            out["unmatched"] += 1
    return out

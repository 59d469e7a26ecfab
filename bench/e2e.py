"""The whole product on CPU: agentic RL on the toy task, and a control run that never learns.

For each seed, two runs on fresh clusters with the same seed and configuration: the RL run
(the configured learning rate) and the control (learning rate 0: same warm-up, same flips,
migrations and versions, weights never change after the warm-up), so the warm-up's share of
the reward is visible. Each run is `cellflip up`'s job headless: scheduler + cell processes,
the trainer and its agents in this process, driving everything through the REST API.
Fields:
- seeds, steps: seeds run, RL steps per run.
- reward_first / reward_last: mean batch reward over the first / last WINDOW steps of the RL
  runs (mean over seeds); reward_control_last: the same for the control runs.
- per_seed: each seed's rewards, held-out scores, staleness_max, clip_frac_mean, lost_rollouts,
  exact_frac and trees (the targets are per seed).
- flips, migrations, lost_rollouts: summed over the RL runs (flips both ways; migrations
  committed during flips to training; episodes abandoned on an error).
- exact_frac: trained-on sampled tokens with an exact old log-prob, over all RL runs.
- max_train_cells: the largest data-parallel group of training cells in any RL step of the RL
  runs (up to `train_cells` = 2 per step; the planner flips them, cells/trainer/step_cells.py).
- trees: forked episodes trained as one tree (the tree loss), summed over the RL runs' steps.
- trainer_compute_s, trainer_state_bytes: every forward, backward and optimizer step the
  trainer process ran (warm-up included), and the tensor bytes it sent or received through
  torch.distributed; both 0: the cells hold and compute the state.
- coordinator_backward_s: seconds the trainer process spent in backward passes of RL steps,
  over the RL runs (the training cells compute; target 0).
- heldout_first / heldout_last: greedy (temperature 0) mean reward on HELDOUT fixed held-out
  episodes (toy_task.heldout_episodes: never trained on, never demonstrated) with the weights
  published first (after the warm-up) and last, mean over the RL runs; heldout_control_last:
  the last weights of the control runs.
- groups_dropped: groups the trainer dropped whole (deadline, stale, ...), summed over RL runs.
- staleness_max: largest staleness (published versions) of a trajectory the scheduler handed
  out in an RL run; staleness_bound: the bound in force (the shipped default, not raised here).
- clip_frac_mean: mean over the RL runs' steps of the share of kept tokens whose PPO ratio was
  clipped (the clip bound).
- updates_rejected: RL updates the trust-region guard rolled back (their KL between
  consecutive policies past the objective's `max_update_kl`), summed over the RL runs;
  update_kl_max: the largest KL(π_prox ‖ π_new) an update measured (k3 with r = π_new/π_prox,
  importance-weighted from the sampler's tokens), over the RL runs (and per seed).
- updates_kept: RL updates kept (each publishes one version), summed over the RL runs;
  versions_published: versions the scheduler's own list (GET /v1/versions) holds past the
  warm-up's, summed over the RL runs; versions_match: the two agree in every RL run (a
  rejected update publishes nothing).
- stale_tokens_dropped: sampled tokens left out of the loss for being more than the
  staleness bound behind the update that would have trained them, summed over the RL runs.
- entropy_mean: the policy's mean entropy (nats) at the sampled tokens, at the updates' start,
  mean over the RL runs' steps (per seed: first and last step).
- wall_s: the whole invocation.

`--rl-jobs N`: N RL jobs on one fleet instead, with the fields of bench/e2e_jobs.py.

`--staleness-bound N` runs with `scheduler.staleness_bound` N (and the trainer's own bound,
policy `drop`, the default) instead of the shipped 8.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import finish, parse_args, set_threads

from cells.localcluster import Cluster
from cells.trainer.client import TrainerClient
from cells.trainer.toy_task import TOY_RENDERER, TaskSpec, heldout_eval
from scheduler.contract.config import parse_config

WINDOW = 3
HELDOUT = 32
"""Held-out episodes scored greedily at the start and the end of each run."""


def make_cfg(tmp: Path, seed: int, steps: int, lr: float | None, quick: bool, bound: int | None = None) -> dict:
    trainer = {"enabled": True, "steps": steps, "seed": seed, "checkpoint_dir": None,
               "batch_episodes": 64, "agents": 16, "group_size": 8, "train_cells": 2,
               "train_cell_choice": "busiest", "long_fraction": 0.1}
    if lr is not None:
        trainer["lr"] = lr
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 10.0, "heartbeat_s": 0.25,
                      "min_rollout_cells": 1, "drain_deadline_s": 60.0,
                      **({"staleness_bound": bound} if bound is not None else {})},
        "cells": {"count": 3, "export_root": str(tmp / "exports"), "engine": {"type": "embedded", "model": {"preset": "toy"},
                                         "num_blocks": 1024, "block_size": 16, "max_running": 8,
                                         "batch_invariant": True}},
        "migration": {"transfer_timeout_s": 20.0},
        "gateway": {"renderer": TOY_RENDERER},
        "trainer": trainer,
    }


def run_one(seed: int, steps: int, lr: float | None, quick: bool, bound: int | None = None) -> dict:
    from cells.trainer.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix=f"cellflip-e2e-{seed}-"))
    raw = make_cfg(tmp, seed, steps, lr, quick, bound)
    c = Cluster(tmp, num_cells=3, cfg=raw, ready_timeout_s=300)
    try:
        trainer = Trainer(parse_config(raw), c.url, run_dir=tmp, tag=f"s{seed}", token=c.trainer_token, agent_token=c.agent_token)
        first: dict = {}
        publish = trainer._publish

        def publish_and_export_first() -> None:  # the first publish follows the warm-up
            publish()
            if not first:  # a cell holding it writes it out (the trainer holds no weights)
                first["version"] = trainer.version
                trainer._export(trainer.version)

        trainer._publish = publish_and_export_first
        run_stop = trainer.cells.hand_back

        def export_last() -> list:  # the run's last version, exported by a cell serving it
            out = run_stop()
            first["last"] = trainer.version
            trainer._export(trainer.version)
            return out

        trainer.cells.hand_back = export_last
        t0 = time.monotonic()
        out = trainer.run()
        out.update(_evaluation(trainer, tmp / "exports" / trainer.tc.export_dir, first, c, seed))
        out["wall_s"] = round(time.monotonic() - t0, 1)
        return out
    finally:
        c.stop()


def _evaluation(trainer, exports: Path, versions: dict, c: Cluster, seed: int) -> dict:
    """Held-out rewards at the start and end (of the first and last versions as cells exported
    them), groups dropped, staleness, clip fraction."""
    from cells.engine.embedded.checkpoint import load_checkpoint

    spec = trainer.spec

    def heldout(v: int | None) -> float | None:
        path = exports / f"v{v}"
        if v is None or not (path / "config.json").is_file():
            return None
        return heldout_eval(spec, load_checkpoint(path, spec), TaskSpec(seed=seed), HELDOUT)["reward"]

    client = TrainerClient(c.url, c.trainer_token)
    try:
        listed = client.versions()
    finally:
        client.close()
    staleness = listed.get("staleness", {})
    steps = [h for h in trainer.history if h.get("event") == "step"]
    clip = [h["clip_frac"] for h in steps if "clip_frac" in h]
    return {"heldout_first": heldout(versions.get("version")), "heldout_last": heldout(versions.get("last")),
            "groups_dropped": sum(trainer.groups.groups_dropped.values()),
            "staleness_max": staleness.get("max_seen"), "staleness_bound": trainer.cfg.scheduler.staleness_bound,
            "clip_frac": clip, "trees": int(sum(h.get("num_trees", 0) for h in steps)),
            "updates_rejected": int(sum(h.get("update_rejected", 0) for h in steps)),
            "update_kl_max": round(max((h.get("update_kl", 0.0) for h in steps), default=0.0), 4),
            "stale_tokens_dropped": int(sum(h.get("stale_tokens_dropped", 0) for h in steps)),
            "entropy": [h["entropy_mean"] for h in steps if "entropy_mean" in h],
            # the scheduler's own list: every version but the warm-up's was published by an update
            "versions_listed": len(listed.get("versions", [])) - 1}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _round_mean(xs: list[float | None], digits: int = 4) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(_mean(xs), digits) if xs else None


def main() -> None:
    def extra(ap) -> None:
        ap.add_argument("--staleness-bound", type=int, default=None,
                        help="scheduler.staleness_bound (default: the shipped 8)")
        ap.add_argument("--rl-jobs", type=int, default=0, metavar="N",
                        help="N RL jobs on one fleet of 4 cells instead (bench/e2e_jobs.py; its own fields)")

    args = parse_args(__doc__, extra)
    set_threads(1)
    if args.rl_jobs:
        from e2e_jobs import run_bench

        from cells.entry import interrupt, stop_on_signals

        stop_on_signals(interrupt)  # a kill stops the fleets' processes too
        say = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
        finish(run_bench(args.rl_jobs, args.quick, say), args, "e2e")
        return
    t0 = time.monotonic()
    seeds, steps = ([0], 8) if args.quick else ([0, 1, 2], 14)
    bound = args.staleness_bound
    per_seed, rl_runs = [], []
    for seed in seeds:
        rl = run_one(seed, steps, None, args.quick, bound)
        ctl = run_one(seed, steps, 0.0, args.quick, bound)
        rl_runs.append(rl)
        per_seed.append({"seed": seed, "reward_first": round(_mean(rl["rewards"][:WINDOW]), 4),
                         "reward_last": round(_mean(rl["rewards"][-WINDOW:]), 4),
                         "reward_control_last": round(_mean(ctl["rewards"][-WINDOW:]), 4),
                         "heldout_first": rl["heldout_first"], "heldout_last": rl["heldout_last"],
                         "heldout_control_last": ctl["heldout_last"], "staleness_max": rl["staleness_max"],
                         "clip_frac_mean": _round_mean(rl["clip_frac"], 6), "lost_rollouts": rl["lost_rollouts"],
                         "exact_frac": rl["exact_frac"], "trees": rl["trees"],
                         "updates_rejected": rl["updates_rejected"], "update_kl_max": rl["update_kl_max"],
                         "updates_kept": rl["updates_kept"], "versions_published": rl["versions_listed"],
                         "stale_tokens_dropped": rl["stale_tokens_dropped"],
                         "entropy_first": _round_mean(rl["entropy"][:1]), "entropy_last": _round_mean(rl["entropy"][-1:]),
                         "wall_s": rl["wall_s"] + ctl["wall_s"]})
        if not args.json:
            print(per_seed[-1], flush=True)
    tokens_exact = [r["exact_frac"] for r in rl_runs if r["exact_frac"] is not None]
    result = {
        "seeds": len(seeds), "steps": steps,
        "reward_first": round(_mean([p["reward_first"] for p in per_seed]), 4),
        "reward_last": round(_mean([p["reward_last"] for p in per_seed]), 4),
        "reward_control_last": round(_mean([p["reward_control_last"] for p in per_seed]), 4),
        "per_seed": per_seed,
        "flips": sum(r["flips"] for r in rl_runs), "migrations": sum(r["migrations"] for r in rl_runs),
        "lost_rollouts": sum(r["lost_rollouts"] for r in rl_runs),
        "exact_frac": round(min(tokens_exact), 6) if tokens_exact else None,
        "max_train_cells": max(r["max_train_cells"] for r in rl_runs),
        "coordinator_backward_s": sum(r["trainer_compute_s"] for r in rl_runs),
        "trainer_compute_s": sum(r["trainer_compute_s"] for r in rl_runs),
        "trainer_state_bytes": sum(r["trainer_state_bytes"] for r in rl_runs),
        "heldout_first": _round_mean([p["heldout_first"] for p in per_seed]),
        "heldout_last": _round_mean([p["heldout_last"] for p in per_seed]),
        "heldout_control_last": _round_mean([p["heldout_control_last"] for p in per_seed]),
        "groups_dropped": sum(r["groups_dropped"] for r in rl_runs),
        "trees": sum(r["trees"] for r in rl_runs),
        "staleness_max": max((r["staleness_max"] for r in rl_runs if r["staleness_max"] is not None), default=None),
        "staleness_bound": rl_runs[0]["staleness_bound"],
        "clip_frac_mean": _round_mean([x for r in rl_runs for x in r["clip_frac"]], 6),
        "updates_rejected": sum(r["updates_rejected"] for r in rl_runs),
        "update_kl_max": max(r["update_kl_max"] for r in rl_runs),
        "updates_kept": sum(r["updates_kept"] for r in rl_runs),
        "versions_published": sum(r["versions_listed"] for r in rl_runs),
        "versions_match": all(r["versions_listed"] == r["updates_kept"] == r["versions_published"] for r in rl_runs),
        "stale_tokens_dropped": sum(r["stale_tokens_dropped"] for r in rl_runs),
        "entropy_mean": _round_mean([x for r in rl_runs for x in r["entropy"]]),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    finish(result, args, "e2e")


if __name__ == "__main__":
    main()

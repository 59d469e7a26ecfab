"""The trainer process: plans, commits and publishes, and drives the RL loop through the public
REST API (the same client an external trainer uses). It holds no model state and computes
nothing: no parameters, moments, EWMA or reference copy, no version, no forward or backward.

What it keeps: the rendezvous store the training cells and publishing cells meet on (keys
and rendezvous only), the configuration the cells build their learners from, the newest
commit record (metadata and per-tensor checksums), the RL loop's counters and data cursor.
Where the rest lives:
    training state      on the cells that computed it, parked through their rollout stints;
                        a joining cell receives it from a peer (cells/training/join.py); a
                        checkpoint one of them writes is the fallback
    versions            published by a cell that computed them (cells/training/holder.py),
                        which also serves their catch-ups; a rollout cell holding a version
                        serves its scoring and its exports
    the warm-up         a supervised run on one training cell (demonstrations are data)

One step: the next `batch_episodes` rollouts of whole groups → declare the step and bring
`train_cells` cells to training (cells/trainer/step_cells.py; their rollouts move live) →
wait for every sampled token's old log-prob → one RL update on the training cells
(cells/training/) → publish v+1 from a cell that computed it (cells/trainer/publish.py) →
the cells return to rollout, installing v+1 from their own state → retired versions leave
the publishing cells. A step whose every cell failed is retried with the next cells.

Start: from the user's Hugging Face directory when `cells.engine.model.path` names one (no
warm-up unless `trainer.warmup_steps` asks for one), else random-initialised and warmed up on
the toy task. A restarted trainer resumes at the newest commit any cell or checkpoint holds.
Every `trainer.export_every`-th published version is exported by a cell holding it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cells.engine.embedded.layers import probe_row_invariance
from cells.engine.embedded.model_spec import resolve_spec
from cells.rl.objectives.config import ObjectiveConfig, ewma_window
from cells.trainer import outcomes
from cells.trainer.agents import AgentPool
from cells.trainer.client import TrainerClient
from cells.trainer.figures import trainer_compute_s, trainer_state_bytes, update_figures
from cells.trainer.groups import GroupGate, num_members
from cells.trainer.publish import drop_retired, export, finish_exports, publish
from cells.trainer.step_cells import StepCells, StepFigures
from cells.trainer.warmup import toy_demos
from cells.training import protocol as P
from cells.training.coordinator import StepFailed, TrainingCoordinator
from cells.training.resume import find_committed
from cells.transport.store import StoreHost
from scheduler.contract.config import CellflipConfig
from scheduler.contract.config.engine import EmbeddedEngineConfig

log = logging.getLogger("cellflip.trainer")
CHECKPOINT = "trainer-state"


def engine_tile(cfg: CellflipConfig) -> int | None:
    """The cells' row tile (what makes scoring and training numerics bitwise equal)."""
    eng = cfg.cells.engine
    if not isinstance(eng, EmbeddedEngineConfig) or not eng.batch_invariant:
        return None
    return eng.row_tile if probe_row_invariance(tile=eng.row_tile) else 1


def resolved_objective(cfg: CellflipConfig, job: dict[str, Any] | None = None) -> ObjectiveConfig:
    """The trainer's objective, its RL job's `objective` keys over the configured ones (`job`:
    `TrainerClient.job_training`), with the EWMA stand-in's window spanning the job's staleness
    bound (versions × `minibatches` steps each), so the cells' learners get the same number."""
    obj = ObjectiveConfig.model_validate({**cfg.trainer.objective, **((job or {}).get("objective") or {})})
    window = ewma_window(obj.ewma, (job or {}).get("staleness_bound", cfg.scheduler.staleness_bound), cfg.trainer.minibatches)
    return obj.model_copy(update={"ewma": obj.ewma.model_copy(update={"staleness_window": window})})


class Trainer:
    def __init__(self, cfg: CellflipConfig, url: str, *, run_dir: str | Path = "runs",
                 token: str | None = None, agent_token: str | None = None, tag: str = "run") -> None:
        """`token`: the trainer's (flips, versions, trajectories, finishing sessions); `agent_token`:
        the toy task's agents' (the gateway only). None: each read as every client reads its
        scope's token (scheduler/contract/tokens.py)."""
        self.cfg, self.tc, self.url = cfg, cfg.trainer, url
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.status_path = self.run_dir / "trainer.jsonl"
        self.client = TrainerClient(url, token)
        model = cfg.cells.engine.model
        self.spec = resolve_spec(model)
        self.pretrained = model.path
        """The user's Hugging Face directory the policy starts from (None: random-initialised)."""
        start = ({"kind": "path", "path": str(Path(model.path).resolve())} if model.path else
                 {"kind": "init", "seed": model.seed, "std": self.tc.init_std})
        self.warmup_steps = self.tc.warmup_steps if self.tc.warmup_steps is not None else (0 if model.path else 300)
        self.store = self._store_host()
        tc = self.tc
        hyper = P.hyper_of(self.spec, resolved_objective(cfg, self.client.job_training()), lr=tc.lr, minibatches=tc.minibatches,
                           tile=engine_tile(cfg), temperature=tc.temperature, lr_warmup_steps=tc.lr_warmup_steps,
                           lr_schedule=tc.lr_schedule, lr_total_steps=tc.steps * tc.minibatches, seed=tc.seed,
                           lr_min_ratio=tc.lr_min_ratio, precision=tc.precision, activation_checkpointing=tc.activation_checkpointing, shard_layout=tc.shard_layout)
        self.coordinator = TrainingCoordinator(hyper, P.param_shapes(self.spec), self.store.address, start=start,
                                               timeout_s=tc.train_timeout_s, ack_timeout_s=tc.train_timeout_s,
                                               emit=self._emit)
        self.agents = AgentPool(url, self.tc, token=agent_token, finish_token=token, run_tag=tag)
        self.history: list[dict[str, Any]] = []
        self.batch: list[dict] = []
        self.groups = GroupGate(self.tc.group_size, deadline_s=self.tc.group_deadline_s,
                                drop_uniform=self.tc.drop_uniform_groups)
        self.rl_step = 0
        """RL steps taken."""
        self.updates_kept = self.updates_rejected = self.versions_published = 0
        """RL updates kept and rejected by the trust-region guard; versions their publishes made."""
        self.lr_scale = 1.0
        """The learning rate's factor after rejected updates (`reject_lr_backoff`, `reject_lr_recovery`)."""
        self.cells = StepCells(self.client, batch_size=self.tc.batch_episodes, train_cells=self.tc.train_cells,
                               choice=self.tc.train_cell_choice, emit=self._emit)
        self.publishers: set[str] = set()
        """Cells that published versions (told to drop the retired ones)."""
        self._pending_checkpoint: tuple[str, str] | None = None
        self._exports: list[str] = []

    def _store_host(self) -> StoreHost:
        """The rendezvous store, on the port the last incarnation of this run used where it is
        free: training cells holding the state reconnect to it after a restart by themselves."""
        path = self.run_dir / "store.json"
        port = json.loads(path.read_text()).get("port", 0) if path.is_file() else 0
        self.restarted = bool(port)  # an earlier incarnation had a store: cells may hold its state
        try:
            host = StoreHost(self.tc.host, port)
        except Exception:  # taken: a fresh port (cells learn it from the next commands)
            host = StoreHost(self.tc.host, 0)
        path.write_text(json.dumps({"port": host.address.port}))
        return host

    version = property(lambda self: self.coordinator.version)

    # -- lifecycle ------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        stop = stop or threading.Event()
        a = self.store.address
        self.client.register_version_host(a.host, a.port)
        try:
            if not self._resume():
                self._start()
            self.coordinator.lr = self.tc.lr * self.lr_scale
            self.cells.declare(0)  # the admission rule's unit: the batch size
            self.agents.start()
            while self.rl_step < self.tc.steps and not stop.is_set():
                self._step(stop)
            self.cells.hand_back()
            return self.summary()
        finally:
            self.flush()
            self.agents.close()
            self.store.close()
            self.client.close()

    def _start(self) -> None:
        """The first state: built on a training cell from the start weights, warmed up there
        (`warmup_steps`; 0 with a user's model), RL begun, published as version 1."""
        self._emit({"event": "warmup_start", "steps": self.warmup_steps})
        demos = toy_demos(self.tc.seed) if self.warmup_steps else []
        while True:
            self.cells.acquire(0)
            cells = self.cells.group()
            try:
                m = self.coordinator.warmup(cells[0], demos, steps=self.warmup_steps, batch_size=self.tc.warmup_batch,
                                            lr=self.tc.warmup_lr, extra=self._extra(), version=self.tc.first_version,
                                            on_progress=self._warmup_progress())
                break
            except (StepFailed, IndexError) as e:
                self._emit({"event": "warmup_failed", "reason": str(e)[:300]})
                self.cells.release(cells)
                time.sleep(1.0)
        self._emit({"event": "model", "source": self.pretrained or "random", "checksum": int(m["joined_checksum"]), "cell": cells[0]})
        self._emit({"event": "warmup_done", "loss": m.get("final_loss"), "wall_s": round(m.get("wall_s", 0.0), 1)})
        self._publish()
        if self.tc.checkpoint_every == 1:  # every commit, the first too: its holder may move to another RL job
            self._checkpoint()
        self.cells.hand_back()  # every cell serves again before the agents start (no step runs)

    def _warmup_progress(self) -> Callable[[dict], None]:
        """Status lines while the warm-up runs on its cell (about every 5%), with an estimate
        of the time left, so the live view shows a progress bar instead of a silent wait."""
        t0 = time.monotonic()

        def report(p: dict) -> None:
            step, total = int(p["step"]), int(p["steps"])
            spent = time.monotonic() - t0
            self._emit({"event": "warmup_progress", "step": step, "steps": total, "loss": round(p["loss"], 4),
                        "eta_s": round(spent / max(step, 1) * (total - step), 1)})
        return report

    def _extra(self, steps: int = 0, kept: int = 0, rejected: int = 0) -> dict[str, Any]:
        """The trainer's counters as of a commit (kept with it on the cells and in checkpoints)."""
        return {"rl_step": self.rl_step + steps, "lr_scale": self.lr_scale,
                "updates_kept": self.updates_kept + kept, "updates_rejected": self.updates_rejected + rejected,
                "versions_published": self.versions_published + kept}

    def _resume(self) -> bool:
        """At the newest commit any cell (reconnected to this store) or checkpoint holds."""
        found = find_committed(self.coordinator.store, [c["id"] for c in self.client.cells()], self._ckpt_path(),
                               wait_s=self.tc.resume_wait_s if self.restarted else 0.0)
        if found is None:
            return False
        commit, holders, ckpt = found
        self.coordinator.adopt(commit, holders, ckpt)
        e = commit.get("extra") or {}
        self.rl_step, self.lr_scale = int(e.get("rl_step", 0)), float(e.get("lr_scale", 1.0))
        self.updates_kept, self.updates_rejected = int(e.get("updates_kept", 0)), int(e.get("updates_rejected", 0))
        self.versions_published = int(e.get("versions_published", 0))
        self.client.cursor = int(commit.get("cursor") or 0)
        known = {v["version"] for v in self.client.versions()["versions"]}
        if commit["version"] not in known:  # committed, never published: publish it now
            self._publish()
        self._emit({"event": "resumed", "step": self.rl_step, "version": commit["version"],
                    "from": "cells" if holders else "checkpoint", "holders": holders})
        return True

    def _ckpt_path(self) -> Path | None:
        return Path(self.tc.checkpoint_dir) / CHECKPOINT if self.tc.checkpoint_dir else None

    def _checkpoint(self) -> None:
        """A cell holding the committed state writes it (parameters, moments, EWMA, reference,
        generator, step, learning-rate position, data cursor, the trainer's counters) off its
        step: safetensors plus a JSON manifest, renamed into place."""
        path = self._ckpt_path()
        if path is None:
            return
        self._finish_checkpoint()
        self._pending_checkpoint = (self.coordinator.checkpoint(str(path.resolve())), str(path.resolve()))

    def _finish_checkpoint(self, timeout_s: float = 600.0) -> None:
        if self._pending_checkpoint is None:
            return
        job, path = self._pending_checkpoint
        self._pending_checkpoint = None
        r = self.coordinator.checkpoint_done(job, path, timeout_s)
        self._emit({"event": "checkpoint" if r.get("ok") else "checkpoint_failed", "path": path, "error": r.get("error")})

    def flush(self) -> None:
        """Wait for the checkpoint and exports being written."""
        try:
            self._finish_checkpoint()
            self._finish_exports()
        except Exception as e:  # the store or the scheduler gone: nothing left to wait for
            log.warning("flush: %s", e)

    # -- one RL step ------------------------------------------------------------------------
    def _step(self, stop: threading.Event) -> None:
        t0 = time.monotonic()
        batch: list[dict] = []
        while num_members(batch) < self.tc.batch_episodes and not stop.is_set():
            self.batch += self.client.trajectories(limit=64)
            batch += self._complete_groups(self.tc.batch_episodes - num_members(batch))
            if num_members(batch) < self.tc.batch_episodes:
                time.sleep(0.2)
        if stop.is_set():
            return
        t_batch = time.monotonic()
        self.cells.acquire(len(batch) + len(self.batch))
        t_flip = time.monotonic()
        batch = self.client.wait_scored(batch, timeout_s=600)
        t_scored = time.monotonic()
        cells = self.cells.group()
        start_version, bound = self.version, self._staleness_bound()
        try:
            metrics = self._update(batch, cells, bound)
        except StepFailed as e:  # no cell could compute it: the batch waits for the next cells
            self._emit({"event": "step_failed", "step": self.rl_step + 1, "reason": str(e)[:300]})
            self.batch = batch + self.batch
            self.cells.release(cells)
            self.cells.declare(0, untrained=len(self.batch))
            return
        self.rl_step += 1
        t_train = time.monotonic()
        if metrics.get("update_rejected"):
            # the guard rejected it: nothing to publish (no number, no broadcast, no cell restarts
            # a request), and the next update takes a smaller step
            self.updates_rejected += 1
            self._set_lr_scale(self.lr_scale * self.tc.reject_lr_backoff)
            self._emit({"event": "update_rejected", "step": self.rl_step, "update_kl": metrics.get("update_kl"),
                        "lr": self.coordinator.lr})
        else:
            self.updates_kept += 1
            self._set_lr_scale(min(1.0, self.lr_scale * self.tc.reject_lr_recovery))
            self._publish()  # under the number the update was committed as (the cells hold it)
            self.versions_published += 1
        self.cells.release(cells)
        prov = [p for t in batch for m, p in zip(t["loss_mask"], t["provenance"], strict=True) if m]
        update = update_figures(metrics, batch, start_version, bound)
        figures = StepFigures(round(t_train - t_flip, 3), len(batch), len(prov), len(cells), update) if cells else None
        self.cells.declare(0, figures, untrained=len(self.batch))
        self._drop_retired()
        if self.rl_step % self.tc.checkpoint_every == 0:
            self._checkpoint()
        self._record(batch, metrics, prov, t0, [t_batch, t_flip, t_scored, t_train])
        outcomes.trained(self, batch, metrics, start_version, bound)  # the export's train_* columns

    def _update(self, batch: list[dict], cells: list[str], bound: int | None) -> dict[str, Any]:
        """The update on the step's cells, committed with the counters it leads to."""
        peers = [c["id"] for c in self.client.cells() if c["state"] not in ("down",)]
        self.coordinator.lr = self.tc.lr * self.lr_scale
        # the counters as they stand after this step, as the guard decided (the commit record
        # carries them; a rejected update keeps its version)
        return self.coordinator.update(batch, cells, next_version=self._next_version, cursor=self.client.cursor,
                                       staleness_bound=bound, peers=peers,
                                       extra=lambda kept: self._extra(1, int(kept), int(not kept)))

    def _record(self, batch: list[dict], metrics: dict, prov: list, t0: float, marks: list[float]) -> None:
        """The step record (trainer.jsonl, the live view, the summary)."""
        t_batch, t_flip, t_scored, t_train = marks
        rewards = [t["reward"] for t in batch]
        flips = self.cells.finished_flips()
        rec = {
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("step", "version")},
            "event": "step", "step": self.rl_step, "version": self.version,
            "reward": sum(rewards) / len(rewards), "episodes": num_members(batch), "sessions": len(batch),
            "tokens": len(prov), "exact": sum(p == "exact" for p in prov), "missing": sum(p == "missing" for p in prov),
            "flips": len(flips), "migrated": sum(f.get("migrated", 0) for f in flips),
            "suspended": sum(f.get("suspended", 0) for f in flips), "planner_flips": self.cells.planner_flips,
            "wait_batch_s": round(t_batch - t0, 2), "flip_s": round(t_flip - t_batch, 2),
            "wait_scored_s": round(t_scored - t_flip, 2), "train_s": round(t_train - t_scored, 2),
            "trainer_compute_s": round(trainer_compute_s(), 4), "trainer_state_bytes": trainer_state_bytes(),
            "step_s": round(time.monotonic() - t0, 2),
            "agents": {"episodes": self.agents.stats.episodes, "lost": self.agents.stats.lost,
                       "retries": self.agents.stats.retries},
        }
        self.history.append(rec)
        self._emit(rec)

    def _complete_groups(self, limit: int) -> list[dict]:
        """Whole groups (all `group_size` members), oldest first, up to about `limit` trajectories,
        taken out of `self.batch`; groups that cannot be trained leave it too, counted here, in
        `cellflip_groups_dropped_total` and in their outcomes (cells/trainer/groups.py)."""
        sel = self.groups.select(self.batch, limit)
        gone = {id(t) for t in sel.ready} | {id(t) for t in sel.dropped_trajectories()}
        self.batch = [t for t in self.batch if id(t) not in gone]
        for reason, dropped in sel.dropped.items():
            groups, n = sel.groups_dropped[reason], len(dropped)
            self._emit({"event": "groups_dropped", "reason": reason, "groups": groups, "trajectories": n})
            try:
                self.client.report_dropped(reason, groups, n)
            except Exception as e:  # the count stays in groups_dropped and the log
                log.warning("could not report dropped groups: %s", e)
        outcomes.dropped(self, sel.dropped)
        return sel.ready

    def _staleness_bound(self) -> int | None:
        """The scheduler's staleness bound where it holds at training (policy `drop`); None
        under `correct` (stale tokens train with their correction weights)."""
        st = self.client.versions().get("staleness") or {}
        return int(st["bound"]) if st.get("policy") == "drop" and st.get("bound") is not None else None

    def _set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale
        self.coordinator.lr = self.tc.lr * scale

    def _next_version(self) -> int:
        """The number the next published version gets: one above the committed one (one per
        RL update, what staleness is measured in), and always newer than any the scheduler has
        seen (a resumed trainer never reuses one)."""
        known = [v["version"] for v in self.client.versions()["versions"]]
        return max(self.version + 1, max(known, default=-1) + 1)

    def _publish(self) -> None:
        publish(self)

    def _export(self, version: int) -> None:
        export(self, version)

    def _finish_exports(self, timeout_s: float = 300.0) -> None:
        finish_exports(self, timeout_s)

    def _drop_retired(self) -> None:
        drop_retired(self)

    # -- reporting --------------------------------------------------------------------------
    def _emit(self, rec: dict[str, Any]) -> None:
        rec = {"t": round(time.time(), 3), **rec}
        with open(self.status_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log.info("%s", json.dumps(rec))

    def summary(self) -> dict[str, Any]:
        steps = [h for h in self.history if h["event"] == "step"]
        tokens = sum(h["tokens"] for h in steps)
        return {
            "steps": len(steps), "rewards": [round(h["reward"], 4) for h in steps],
            "flips": sum(h["flips"] for h in steps), "migrations": sum(h["migrated"] for h in steps),
            "lost_rollouts": self.agents.stats.lost,
            "exact_frac": (sum(h["exact"] for h in steps) / tokens) if tokens else None,
            "version": self.version,
            "max_train_cells": max((int(h.get("train_cells", 0)) for h in steps), default=0),
            "trainer_compute_s": trainer_compute_s(), "trainer_state_bytes": trainer_state_bytes(),
            "updates_kept": self.updates_kept, "updates_rejected": self.updates_rejected,
            "versions_published": self.versions_published,
        }

"""The trainer process: owns what must outlive any cell's role, and drives the RL loop through
the public REST API (the same client an external trainer uses).

State it owns: parameters and optimizer state (the Learner), every unretired version in host
memory (its VersionHost, which cells broadcast from and catch up from), the reference and
PPO-EWMA copies, the data cursor; checkpointed every few steps and resumed from.

One step:
    batch   the next `batch_episodes` rollouts of whole groups (agents keep playing meanwhile)
    cells   declare the step (POST /v1/trainer/report) and bring `train_cells` cells to training
            — the planner flips them, or the trainer does (cells/trainer/step_cells.py); their
            in-flight rollouts move live to other cells
    wait    until every sampled token of the batch has its old log-prob (exact, or missing)
    train   one RL update on the training cells, data-parallel (cells/training/): this process
            plans and coordinates, the cells compute; the new state comes back to the host copy
    publish version v+1: host copy → POST /v1/versions → broadcast to the rollout cells
    back    the training cells return to rollout (loading: they already hold v+1 and install it
            locally after checking its checksum; nothing is sent to them); report the step
    retire  superseded versions leave the host once the scheduler retired them (all scored)
The report declares the trainer's batch size, which the staleness bound's admission rule
counts in. This process runs no forward or backward in RL steps unless no cell could train
(every attempt failed, or no cell reached training): then it computes the update itself,
counted as `coordinator_fallback`. The supervised warm-up runs here.

Start: from the user's Hugging Face directory when `cells.engine.model.path` names one (no
warm-up unless `trainer.warmup_steps` asks for one), else random-initialised and warmed up on
the toy task. Every `trainer.export_every`-th published version is written as a Hugging Face
directory (cells/engine/embedded/checkpoint.py) on a thread of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cells.engine.embedded.checkpoint import load_checkpoint, save_checkpoint
from cells.engine.embedded.layers import probe_row_invariance
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.rl.learner import Learner
from cells.rl.objectives.config import ObjectiveConfig, ewma_window
from cells.trainer import state_files
from cells.trainer.agents import AgentPool
from cells.trainer.client import TrainerClient
from cells.trainer.groups import GroupGate, num_members
from cells.trainer.step_cells import StepCells, StepFigures
from cells.trainer.versions_host import VersionHost
from cells.trainer.warmup import run_warmup
from cells.trainer.writer import BackgroundWriter
from cells.training.coordinator import TrainingCoordinator
from cells.training.wire import weights_checksum
from scheduler.contract.config import CellflipConfig, EmbeddedEngineConfig

log = logging.getLogger("cellflip.trainer")

CHECKPOINT = "trainer-state"


def engine_tile(cfg: CellflipConfig) -> int | None:
    """The cells' row tile (what makes scoring and training numerics bitwise equal)."""
    eng = cfg.cells.engine
    if not isinstance(eng, EmbeddedEngineConfig) or not eng.batch_invariant:
        return None
    return eng.row_tile if probe_row_invariance(tile=eng.row_tile) else 1


def resolved_objective(cfg: CellflipConfig) -> ObjectiveConfig:
    """The trainer's objective with what it leaves to the deployment filled in: the EWMA
    stand-in's window spans the scheduler's staleness bound (`staleness_bound` versions ×
    `minibatches` optimizer steps each), so the cells' learners get the same concrete number."""
    obj = ObjectiveConfig.model_validate(cfg.trainer.objective)
    window = ewma_window(obj.ewma, cfg.scheduler.staleness_bound, cfg.trainer.minibatches)
    return obj.model_copy(update={"ewma": obj.ewma.model_copy(update={"staleness_window": window})})


def update_figures(metrics: dict, batch: list[dict], start_version: int, bound: int | None) -> dict:
    """What the scheduler's `cellflip_training_*` metrics show of one update: its KL, grad
    norm, clip fraction, entropy, outcome, and its trained tokens by versions behind its start."""
    behind: list[int] = []
    for t in batch:
        for m, v in zip(t["loss_mask"], t["versions"], strict=True):
            k = start_version - v if m and v is not None else None
            if k is None or (bound is not None and k > bound):
                continue  # a prompt token, or one the bound left out of the loss
            k = max(0, min(k, 64))
            behind += [0] * (k + 1 - len(behind))
            behind[k] += 1
    return {"update_kl": float(metrics.get("update_kl", 0.0)), "grad_norm": float(metrics.get("grad_norm", 0.0)),
            "clip_frac": float(metrics.get("clip_frac", 0.0)), "entropy": float(metrics.get("entropy_mean", 0.0)),
            "rejected": bool(metrics.get("update_rejected")), "staleness": behind}


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
        torch.manual_seed(self.tc.seed)
        self.pretrained = model.path
        """The user's Hugging Face directory the policy starts from (None: random-initialised)."""
        start = load_checkpoint(model.path, self.spec) if model.path else init_weights(self.spec, model.seed,
                                                                                          std=self.tc.init_std)
        self.start_checksum = weights_checksum(start)
        self.warmup_steps = self.tc.warmup_steps if self.tc.warmup_steps is not None else (0 if model.path else 300)
        self.writer = BackgroundWriter(self._emit)
        """Checkpoints and exports, written off the step."""
        self.learner = Learner(self.spec, start, lr=self.tc.warmup_lr,
                               objective=resolved_objective(cfg),
                               tile=engine_tile(cfg), temperature=self.tc.temperature, seed=self.tc.seed,
                               minibatches=self.tc.minibatches, lr_warmup_steps=self.tc.lr_warmup_steps,
                               lr_schedule=self.tc.lr_schedule, lr_min_ratio=self.tc.lr_min_ratio,
                               lr_total_steps=self.tc.steps * self.tc.minibatches)
        self.host = VersionHost(self.tc.host, 0, bucket_bytes=cfg.versions.bucket_bytes,
                                update_backend=cfg.versions.update_backend)
        self.coordinator = TrainingCoordinator(self.learner, self.host.address, timeout_s=self.tc.train_timeout_s,
                                               ack_timeout_s=self.tc.train_timeout_s, emit=self._emit)
        self.agents = AgentPool(url, self.tc, token=agent_token, finish_token=token, run_tag=tag)
        self.history: list[dict[str, Any]] = []
        self.batch: list[dict] = []
        self.groups = GroupGate(self.tc.group_size, deadline_s=self.tc.group_deadline_s,
                                drop_uniform=self.tc.drop_uniform_groups)
        self.rl_step = 0
        """RL steps taken (the learner's own count includes the warm-up's steps)."""
        self.updates_kept = self.updates_rejected = self.versions_published = 0
        """RL updates kept and rejected by the trust-region guard; versions their publishes made."""
        self.lr_scale = 1.0
        """The learning rate's factor after rejected updates (`reject_lr_backoff`, `reject_lr_recovery`)."""
        self.cells = StepCells(self.client, batch_size=self.tc.batch_episodes, train_cells=self.tc.train_cells,
                               choice=self.tc.train_cell_choice, emit=self._emit)

    # -- lifecycle ------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        stop = stop or threading.Event()
        self.host.start()
        try:
            resumed = self._resume()
            if not resumed:
                self._emit({"event": "model", "source": self.pretrained or "random", "checksum": self.start_checksum})
                if self.warmup_steps:
                    self._emit({"event": "warmup_start", "steps": self.warmup_steps})
                    w = run_warmup(self.learner, steps=self.warmup_steps, batch_size=self.tc.warmup_batch,
                                   seed=self.tc.seed, on_step=self._warmup_progress())
                    self._emit({"event": "warmup_done", "loss": w["final_loss"], "wall_s": round(w["wall_s"], 1)})
                self._begin_rl()
                self._publish()
            self.learner.lr = self.tc.lr
            self.cells.declare(0)  # the admission rule's unit: the batch size
            self.agents.start()
            while self.rl_step < self.tc.steps and not stop.is_set():
                self._step(stop)
            self.cells.hand_back()
            return self.summary()
        finally:
            self.flush()
            self.agents.close()
            self.host.close()
            self.client.close()

    def _warmup_progress(self) -> Callable[[int, float], None]:
        """Status lines while the warm-up runs (about every 5%), with an estimate of the time
        left, so the live view shows a progress bar instead of a silent wait."""
        total, t0 = self.warmup_steps, time.monotonic()
        every = max(1, total // 20)

        def report(step: int, loss: float) -> None:
            if step % every == 0 or step == total:
                spent = time.monotonic() - t0
                self._emit({"event": "warmup_progress", "step": step, "steps": total, "loss": round(loss, 4),
                            "eta_s": round(spent / step * (total - step), 1)})
        return report

    def _resume(self) -> bool:
        path = self._ckpt_path()
        if path is None or not state_files.exists(path):
            return False
        state = state_files.load_state(path)
        self.learner.load_state_dict(state["learner"])
        self.rl_step = int(state["rl_step"])
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.updates_kept = int(state.get("updates_kept", 0))
        self.updates_rejected = int(state.get("updates_rejected", 0))
        self.client.cursor = self.learner.cursor
        self._publish()  # cells may hold anything: give them these weights
        self._emit({"event": "resumed", "step": self.rl_step, "version": self.learner.version})
        return True

    def _ckpt_path(self) -> Path | None:
        return Path(self.tc.checkpoint_dir) / CHECKPOINT if self.tc.checkpoint_dir else None

    def _checkpoint(self) -> None:
        """Copy the state now (parameters, moments, EWMA, reference, RNG, step, learning-rate
        scale, data cursor) and write it off the step (cells/trainer/state_files.py: safetensors
        plus a JSON manifest, renamed into place: a crash mid-write leaves the previous one)."""
        path = self._ckpt_path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self.learner.cursor = self.client.cursor
        state = {"learner": self.learner.state_dict(), "rl_step": self.rl_step, "lr_scale": self.lr_scale,
                 "updates_kept": self.updates_kept, "updates_rejected": self.updates_rejected}
        self.writer.submit("checkpoint", lambda: state_files.save_state(path, state), step=self.rl_step)

    def flush(self) -> None:
        """Wait for the checkpoint and exports being written."""
        self.writer.flush()

    def _begin_rl(self) -> None:
        """The warmed-up policy is where RL starts: the KL reference (when a KL term is
        configured) anchors at it, not at the initial weights; the optimizer's moments are
        dropped and the RL learning-rate warm-up starts (`Learner.start_rl`)."""
        self.learner.set_reference()
        self.learner.start_rl()

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
        self._flip_to_training(untrained=len(batch) + len(self.batch))
        t_flip = time.monotonic()
        batch = self.client.wait_scored(batch, timeout_s=600)
        t_scored = time.monotonic()
        cells = self.cells.group()
        start_version, bound = self.learner.version, self._staleness_bound()
        metrics = self.coordinator.update(batch, cells, next_version=self._next_version, cursor=self.client.cursor,
                                          staleness_bound=bound)
        self.rl_step += 1
        t_train = time.monotonic()
        if metrics.get("update_rejected"):
            # the guard rejected it: nothing to publish (no number, no broadcast, no cell restarts
            # a request), and the next update takes a smaller step
            self.updates_rejected += 1
            self._set_lr_scale(self.lr_scale * self.tc.reject_lr_backoff)
            self._emit({"event": "update_rejected", "step": self.rl_step, "update_kl": metrics.get("update_kl"),
                        "lr": self.learner.lr})
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

    def _record(self, batch: list[dict], metrics: dict, prov: list, t0: float, marks: list[float]) -> None:
        """The step record (trainer.jsonl, the live view, the summary)."""
        t_batch, t_flip, t_scored, t_train = marks
        rewards = [t["reward"] for t in batch]
        flips = self.cells.finished_flips()
        rec = {
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in ("step", "version")},
            "event": "step", "step": self.rl_step, "version": self.learner.version,
            "reward": sum(rewards) / len(rewards), "episodes": num_members(batch), "sessions": len(batch),
            "tokens": len(prov), "exact": sum(p == "exact" for p in prov), "missing": sum(p == "missing" for p in prov),
            "flips": len(flips), "migrated": sum(f.get("migrated", 0) for f in flips),
            "suspended": sum(f.get("suspended", 0) for f in flips), "planner_flips": self.cells.planner_flips,
            "wait_batch_s": round(t_batch - t0, 2), "flip_s": round(t_flip - t_batch, 2),
            "wait_scored_s": round(t_scored - t_flip, 2), "train_s": round(t_train - t_scored, 2),
            "coordinator_forward_s": round(self.learner.compute_s["forward"], 4),
            "coordinator_backward_s": round(self.learner.compute_s["backward"], 4),
            "step_s": round(time.monotonic() - t0, 2),
            "agents": {"episodes": self.agents.stats.episodes, "lost": self.agents.stats.lost,
                       "retries": self.agents.stats.retries},
        }
        self.history.append(rec)
        self._emit(rec)

    def _complete_groups(self, limit: int) -> list[dict]:
        """Whole groups (all `group_size` members finished), oldest first, up to about `limit`
        trajectories, taken out of `self.batch`. Groups that cannot be trained (past the
        deadline, a member dropped by the scheduler as stale, equal rewards under dynamic
        sampling) leave it too, counted here and in the scheduler's
        `cellflip_groups_dropped_total` (cells/trainer/groups.py)."""
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
        return sel.ready

    def _flip_to_training(self, untrained: int = 0) -> list[dict]:
        """Declare the step and bring its cells to the training role (cells/trainer/step_cells.py)."""
        return self.cells.acquire(untrained)

    def _staleness_bound(self) -> int | None:
        """The scheduler's staleness bound where it holds at training (policy `drop`); None
        under `correct` (stale tokens train with their correction weights)."""
        st = self.client.versions().get("staleness") or {}
        return int(st["bound"]) if st.get("policy") == "drop" and st.get("bound") is not None else None

    def _set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale
        self.learner.lr = self.tc.lr * scale

    def _next_version(self) -> int:
        """The number the next published version gets: the learner's (one per RL update, what
        staleness is measured in), and always newer than any the scheduler has seen (a
        resumed trainer never reuses one)."""
        known = [v["version"] for v in self.client.versions()["versions"]]
        return max(self.learner.version, max(known, default=-1) + 1)

    def _publish(self) -> None:
        """Publish the current parameters under `_next_version()`: after a training step,
        the number the update was committed as (nothing newer was published since), which
        the cells that computed it hold."""
        t0 = time.monotonic()
        version = self._next_version()
        self.host.put(version, self.learner.weights())
        a = self.host.address
        r = self.client.publish(version, a.host, a.port, self.host.namespace)
        res = self.host.broadcast(version, r["receivers"], r.get("receiver_ranks", {}))
        self.learner.version = version
        self._emit({"event": "published", "version": version, "receivers": len(r["receivers"]),
                    "delivered": len(res.delivered), "failed": sorted(res.failed),
                    "seconds": round(time.monotonic() - t0, 2)})
        if self.tc.export_every and version % self.tc.export_every == 0:
            self._export(version)

    def _export(self, version: int) -> None:
        """Write `version` as a Hugging Face directory off the step, from a copy of the weights."""
        weights = {k: v.detach().clone() for k, v in self.learner.weights().items()}
        path, dtype = Path(self.tc.export_dir) / f"v{version}", getattr(torch, self.tc.export_dtype)
        self.writer.submit("export", lambda: save_checkpoint(path, self.spec, weights, dtype, source=self.pretrained,
                                                             version=version), version=version, path=str(path))

    def _drop_retired(self) -> None:
        held = set(self.host.versions())
        for v in self.client.versions()["versions"]:
            if v["state"] == "retired" and v["version"] in held:
                self.host.drop(v["version"])

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
            "version": self.learner.version,
            "max_train_cells": max((int(h.get("train_cells", 0)) for h in steps), default=0),
            "coordinator_forward_s": self.learner.compute_s["forward"],
            "coordinator_backward_s": self.learner.compute_s["backward"],
            "coordinator_fallbacks": sum(int(h.get("coordinator_fallback", 0)) for h in steps),
            "updates_kept": self.updates_kept, "updates_rejected": self.updates_rejected,
            "versions_published": self.versions_published,
        }

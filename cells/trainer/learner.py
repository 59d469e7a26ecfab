"""The learning core: fp32 parameters, AdamW, and the decoupled PPO step over stored trajectories.

Every sequence is scored by its own cache-free forward, `token_logprobs(prepare(spec, params),
ids, temperature, tile)` -- the function the cells' batch-invariant engine scores with, at the
same row tile -- so at the first update on a version sampled and scored in batch-invariant
mode lp_theta equals the cells' old log-probs bitwise (reported as `frac_bitwise_equal`).

One `rl_step` is one RL update (one published version) over a batch of trajectories in the
store's `to_api` format, run in this process by cells/training/update.py -- the code the
training cells run on their shares of the same plan (cells/training/plan.py): group-relative
advantages of the task reward per `group_id`, each segment of a session its own sequence,
`minibatches` optimizer steps with lp_prox from one detached forward at the start of the
update, the PPO-EWMA stand-in where old log-probs are missing or unscored, and KL to the
reference when configured. Each minibatch's loss is normalised by its global token count.

Why the forward runs on a compacted vocabulary when the output ids are restricted: the
embedding (tied to the output layer) has 151,936 rows, and autograd through `index_select`
materialises a dense gradient of the whole table per use -- on CPU most of a step's time.
Each micro-batch therefore uses a leaf copy of only the rows its tokens and the output ids
touch, ids remapped monotonically; the same rows in the same order enter the same kernels, so
the log-probs are bitwise those of the full model (tested), and the rows' gradient is added
back into the full table once.

    python -m cells.trainer.learner --selfcheck     # warm-up, then RL vs an lr = 0 control
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from cells.engine.layers import rope_tables
from cells.engine.model import check_weights, prepare, token_logprobs
from cells.engine.model_spec import ModelSpec
from cells.trainer.objectives import PPOEWMA, GRPOAdvantage, ObjectiveConfig, RLOOAdvantage
from cells.training.batch import EXACT, MISSING  # noqa: F401  (re-exported)
from cells.training.plan import plan_update
from cells.training.reduce import LocalReducer
from cells.training.update import run_update

STATE_FORMAT = 1
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def id_ranges(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Token ids as sorted half-open ranges (the form of ModelSpec.output_id_ranges)."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


class Learner:
    """Parameters, optimizer, reference and PPO-EWMA copies, and the two kinds of step."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, Tensor],
        *,
        lr: float,
        objective: ObjectiveConfig | None = None,
        tile: int | None = 4,
        output_ids: Sequence[int] | None = None,
        temperature: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        micro_batch: int = 16,
        minibatches: int = 1,
        lr_warmup_steps: int = 0,
        sft_tile: int | None = None,
        version: int = 0,
        seed: int = 0,
        reference: dict[str, Tensor] | None = None,
    ) -> None:
        """`tile` must be the cells' row tile (batch-invariant mode) for bitwise old log-probs,
        `temperature` their sampling temperature; `output_ids` overrides the spec's output
        vocabulary; `reference` (the KL anchor) defaults to `weights`. `sft_tile` is the row
        tile of the warm-up forward: None runs the fast kernels (warm-up needs no bitwise
        match)."""
        if output_ids is not None:
            spec = replace(spec, output_id_ranges=id_ranges(output_ids))
        check_weights(spec, weights)
        self.spec = spec
        self.objective = objective or ObjectiveConfig()
        self.tile = tile
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.micro_batch = micro_batch
        self.minibatches = minibatches
        """Optimizer steps per RL update (k >= 2 lets the clip bind from the second; docs/RL.md)."""
        self.lr_warmup_steps = lr_warmup_steps
        self.rl_start_step: int | None = None
        self.compute_s = {"forward": 0.0, "backward": 0.0}
        self.last_lr = float(lr)
        """The learning rate of the last optimizer step (after the warm-up's scaling)."""
        """Seconds this process spent in RL forwards and backwards (`run_update`)."""
        """The optimizer step RL started at (`start_rl`); None: no RL learning-rate warm-up."""
        self.betas, self.weight_decay = betas, weight_decay
        self._base_lr = float(lr)
        self.sft_tile = sft_tile
        # Sorted names: the optimizer's state is indexed by position, checkpoints by name.
        self.params: dict[str, Tensor] = {
            k: weights[k].detach().to(torch.float32).clone().requires_grad_(True)
            for k in sorted(weights)
        }
        # fused: one kernel over each tensor instead of a dozen passes (the step of a 152k-row
        # table dominated a CPU update); every rank runs the same one, so ranks stay equal.
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        self.reference: dict[str, Tensor] = {}
        self.set_reference(reference if reference is not None else weights)
        ew = self.objective.ewma
        self.ewma = PPOEWMA(self.params, staleness_window=ew.staleness_window,
                            reset_threshold=ew.reset_threshold)
        self.version = version
        """Version of the current parameters (what `weights()` publishes)."""
        self.step = 0
        """Optimizer steps taken."""
        self.cursor = 0
        """The caller's data cursor (e.g. the store's trajectory cursor); checkpointed."""
        self.generator = torch.Generator().manual_seed(seed)
        """The caller's RNG for data order (checkpointed)."""
        self._rope = rope_tables(spec.head_dim, spec.max_position, spec.rope_theta)
        out = spec.output_ids()
        self._out_ids = torch.tensor(out, dtype=torch.long) if out is not None else None

    # -- parameters ------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The base learning rate (the warm-up scales it per step, `lr_scale`)."""
        return self._base_lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._base_lr = float(value)
        for g in self.optimizer.param_groups:
            g["lr"] = value

    def weights(self) -> dict[str, Tensor]:
        """A detached copy of the parameters, for publishing as version `self.version`."""
        return {k: v.detach().clone() for k, v in self.params.items()}

    def set_reference(self, weights: dict[str, Tensor] | None = None) -> None:
        """The KL reference: `weights`, or the current parameters (e.g. when RL starts after
        a warm-up)."""
        src = self.params if weights is None else weights
        self.reference = {k: src[k].detach().to(torch.float32).clone() for k in sorted(src)}

    # -- the forward -------------------------------------------------------------------------
    def _compact(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool
                 ) -> tuple[ModelSpec, dict[str, Tensor], Tensor | None, list[Tensor]]:
        """The model restricted to the vocabulary rows that `seqs` and the output ids use.

        Returns (spec, weights with leaf copies of those rows when `grad`, the rows, the
        remapped ids). Without restricted output ids the softmax spans the whole vocabulary,
        so nothing is compacted (rows None)."""
        if self._out_ids is None:
            w = {k: (v if grad else v.detach()) for k, v in weights.items()}
            return self.spec, w, None, list(seqs)
        rows = torch.unique(torch.cat([*seqs, self._out_ids]))  # sorted: output order kept
        out = torch.searchsorted(rows, self._out_ids).tolist()
        spec = replace(self.spec, vocab_size=len(rows), output_id_ranges=id_ranges(out))
        w = dict(weights)
        for name in (_EMBED, _HEAD):
            if name in w:
                sub = w[name].detach().index_select(0, rows)
                w[name] = sub.requires_grad_(True) if grad else sub
        return spec, w, rows, [torch.searchsorted(rows, s) for s in seqs]

    def _logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool,
                  tile: int | None | str = "cells"
                  ) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        """Per-token log-probs (index t = token t, 0 at t = 0) of each sequence, with the
        cells' row tile unless `tile` says otherwise."""
        tile = self.tile if tile == "cells" else tile
        spec, w, rows, remapped = self._compact(weights, seqs, grad)
        with torch.set_grad_enabled(grad):
            prep = prepare(spec, w, self._rope)
            out = []
            for ids in remapped:
                lp = token_logprobs(prep, ids, self.temperature, tile)
                out.append(torch.cat([lp.new_zeros(1), lp]))
        return out, w, rows

    def logprobs(self, token_ids: Sequence[int], which: str = "current") -> Tensor:
        """Log-probs of tokens 1..L−1 under the current, reference or EWMA parameters (the
        layout of `token_logprobs`), without gradient."""
        weights = {"current": self.params, "reference": self.reference,
                   "ewma": self.ewma.params}[which]
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        (lp,), _, _ = self._logprobs(weights, [ids], grad=False)
        return lp[1:].detach()

    def _accumulate_rows(self, w: dict[str, Tensor], rows: Tensor | None) -> None:
        """Add the compact rows' gradients into the full tables' gradients."""
        if rows is None:
            return
        for name in (_EMBED, _HEAD):
            if name in w and w[name].grad is not None:
                full = self.params[name]
                if full.grad is None:
                    full.grad = torch.zeros_like(full)
                full.grad.index_add_(0, rows, w[name].grad)

    def _optimizer_step(self) -> float:
        """Clip, step, and advance the version; returns the gradient norm before clipping."""
        params = [p for p in self.params.values() if p.grad is not None]
        if not params:
            raise ValueError("no gradient to apply")
        if self.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.version += 1
        return norm

    # -- supervised warm-up ----------------------------------------------------------------
    def sft_step(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, float]:
        """One optimizer step of the token-mean negative log-likelihood of the loss-masked
        tokens of `batch` ((token ids, loss mask) pairs)."""
        seqs = []
        for ids, m in batch:
            mask = torch.tensor([bool(x) for x in m])
            if len(mask) != len(ids):
                raise ValueError(f"loss mask has {len(mask)} entries for {len(ids)} tokens")
            mask[0] = False  # nothing predicts the first token
            seqs.append((torch.tensor(list(ids), dtype=torch.long), mask))
        n_tok = sum(int(m.sum()) for _, m in seqs)
        if n_tok == 0:
            raise ValueError("the batch has no loss-masked tokens")
        total = 0.0
        for i in range(0, len(seqs), self.micro_batch):
            chunk = seqs[i : i + self.micro_batch]
            lps, w, rows = self._logprobs(self.params, [s for s, _ in chunk], True, self.sft_tile)
            loss = -sum(torch.where(m, lp, 0.0).sum() for lp, (_, m) in zip(lps, chunk)) / n_tok
            if not torch.isfinite(loss):
                raise ValueError("a loss-masked token lies outside the model's output ids")
            loss.backward()
            self._accumulate_rows(w, rows)
            total += float(loss.detach())
        norm = self._optimizer_step()
        self.ewma.update(self.params)
        return {"loss": total, "tokens": float(n_tok), "grad_norm": norm, "lr": self.lr,
                "version": float(self.version)}

    # -- the RL step -------------------------------------------------------------------------
    def start_rl(self) -> None:
        """RL begins here: the optimizer's moments from the warm-up are dropped (they describe
        another objective's gradients) and the learning-rate warm-up counts from this step.
        Versions restart here: the warmed-up weights are version 1 and each RL update adds one
        (the supervised steps before it are optimizer steps, not versions)."""
        self.optimizer.state.clear()
        self.rl_start_step = self.step
        self.version = 1

    def rl_step(self, trajectories: Sequence[dict[str, Any]], *, cursor: int | None = None
                ) -> dict[str, float]:
        """One RL update (`minibatches` optimizer steps, one published version) of the
        decoupled PPO objective over finished `trajectories` (the store's `to_api` format),
        computed in this process; returns the update's metrics. The cells of a training group
        run the same `run_update` on their shares of the same plan.

        Trajectories whose group has fewer than two members are dropped (their advantage is
        undefined; counted in `num_dropped`). `cursor`, when given, becomes the checkpointed
        data cursor."""
        plan = plan_update(trajectories, self.objective, self.minibatches, [1.0])
        metrics = run_update(self, plan.shares[0], LocalReducer())
        if cursor is not None:
            self.cursor = cursor
        metrics.update(plan.metrics())
        return metrics

    # -- what `run_update` calls ----------------------------------------------------------------
    def seq_logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool
                     ) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        """Per-token log-probs of `seqs` under `weights` at the cells' tile (see `_logprobs`)."""
        return self._logprobs(weights, seqs, grad)

    def zero_grads(self) -> dict[str, Tensor]:
        """Zero gradients for every parameter (a rank with no rows adds zeros to the sum), and
        the per-row marks of the vocabulary tables that `add_row_grads` fills."""
        for p in self.params.values():
            p.grad = torch.zeros_like(p)
        if self._out_ids is None:
            return {}
        return {k: torch.zeros(self.params[k].shape[0], dtype=torch.bool)
                for k in (_EMBED, _HEAD) if k in self.params}

    def add_row_grads(self, w: dict[str, Tensor], rows: Tensor | None, touched: dict[str, Tensor]) -> None:
        self._accumulate_rows(w, rows)
        if rows is not None:
            for m in touched.values():
                m[rows] = True

    @torch.no_grad()
    def update_ewma(self) -> None:
        """Fold the parameters into the EWMA copy. Rows of the vocabulary tables where the
        average equals the parameters (rows no step has moved) stay bitwise equal to them:
        beta·W/W'·x + 1/W'·x is x in exact arithmetic but not always in floats, and exact
        equality keeps those rows off the wire when a cell joins (cells/training/wire.py)."""
        same = {k: torch.nonzero((self.ewma.params[k] == self.params[k]).all(dim=1)).flatten()
                for k in (_EMBED, _HEAD) if k in self.params and k in self.ewma.params}
        self.ewma.update(self.params)
        for k, rows in same.items():
            self.ewma.params[k].index_copy_(0, rows, self.params[k].detach().index_select(0, rows))

    def apply_gradients(self) -> float:
        """Clip, one optimizer step at the scheduled learning rate; the version is the
        caller's. Returns the gradient norm before clipping."""
        params = list(self.params.values())
        if self.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        self.last_lr = self._base_lr * self.lr_scale()
        for g in self.optimizer.param_groups:
            g["lr"] = self.last_lr
        try:
            self.optimizer.step()
        finally:
            for g in self.optimizer.param_groups:
                g["lr"] = self._base_lr
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def lr_scale(self) -> float:
        """Linear learning-rate warm-up over the first `lr_warmup_steps` optimizer steps of RL."""
        if self.rl_start_step is None or self.lr_warmup_steps <= 0:
            return 1.0
        return min(1.0, (self.step - self.rl_start_step + 1) / self.lr_warmup_steps)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Parameters, reference, EWMA, optimizer, RNG, version and data cursor: tensors and
        JSON-able metadata only (loadable with `torch.load(weights_only=True)`)."""
        return {
            "params": {k: v.detach().clone() for k, v in self.params.items()},
            "reference": {k: v.clone() for k, v in self.reference.items()},
            "ewma": {k: v.clone() for k, v in self.ewma.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": self.generator.get_state(),
            "meta": {
                "format": STATE_FORMAT,
                "version": self.version,
                "step": self.step,
                "rl_start_step": self.rl_start_step,
                "cursor": self.cursor,
                "ewma_num_resets": self.ewma.num_resets,
                "param_names": list(self.params),
                "spec": json.dumps(self.spec.signature(), sort_keys=True),
                "objective": self.objective.model_dump_json(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; the model spec and parameter names must match."""
        meta = state["meta"]
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown learner state format {meta.get('format')!r}")
        if meta["spec"] != json.dumps(self.spec.signature(), sort_keys=True):
            raise ValueError("the checkpoint was written for another model spec")
        if list(meta["param_names"]) != list(self.params):
            raise ValueError("the checkpoint's parameter names differ from this learner's")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state["params"][k])
        self.set_reference(state["reference"])
        self.ewma.load_state_dict(state["ewma"])
        self.ewma.num_resets = int(meta["ewma_num_resets"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._base_lr = float(self.optimizer.param_groups[0]["lr"])
        self.generator.set_state(state["rng"])
        self.version, self.step = int(meta["version"]), int(meta["step"])
        self.cursor = int(meta["cursor"])
        start = meta.get("rl_start_step")
        self.rl_start_step = None if start is None else int(start)


# -- the learnability check ---------------------------------------------------------------------
@dataclass(frozen=True)
class CheckConfig:
    """Knobs of the learnability check (defaults: a few CPU minutes on one thread)."""

    seed: int = 0
    preset: str = "toy"
    init_std: float = 0.1
    """Initial weight scale: at 0.1 (not the engine's 0.02) the warm-up finds the circuits
    that copy item numbers and codes within ~250 steps."""
    warmup_steps: int = 300
    warmup_batch: int = 16
    warmup_lr: float = 3e-3
    num_demos: int = 512
    rl_steps: int = 10
    rl_lr: float = 2e-3
    groups: int = 16
    """Episodes per RL step (each a GRPO group)."""
    samples: int = 8
    """Sessions per episode."""
    eval_episodes: int = 64
    eval_samples: int = 2
    advantage: str = "grpo"
    """`grpo` or `rloo`."""
    tile: int = 4
    max_turns: int = 6

    def objective(self) -> ObjectiveConfig:
        adv = GRPOAdvantage() if self.advantage == "grpo" else RLOOAdvantage()
        return ObjectiveConfig(advantage=adv)


def evaluate(sampler: Any, episodes: Sequence[Any], samples: int, tag: str, max_turns: int
             ) -> dict[str, float]:
    """Mean reward and success rate of the served weights on fixed episodes and session ids
    (the sampler is deterministic: equal weights give equal rollouts)."""
    _, stats = sampler.rollouts(episodes, samples=samples, tag=tag, max_turns=max_turns)
    n = len(stats)
    return {"reward": sum(s["reward"] for s in stats) / n,
            "solved": sum(s["solved"] for s in stats) / n}


def selfcheck(cfg: CheckConfig | None = None, log: Any = print) -> dict[str, Any]:
    """Warm-up, then RL against the lr = 0 control, on the toy task (see `rl_check`)."""
    from cells.engine.model import init_weights
    from cells.engine.model_spec import PRESETS
    from cells.trainer.toy_task import TaskSpec
    from cells.trainer.warmup import run_warmup

    cfg = cfg or CheckConfig()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    spec = PRESETS[cfg.preset]
    learner = Learner(spec, init_weights(spec, cfg.seed, cfg.init_std), lr=cfg.warmup_lr,
                      objective=cfg.objective(), tile=cfg.tile, seed=cfg.seed)
    warm = run_warmup(learner, steps=cfg.warmup_steps, batch_size=cfg.warmup_batch,
                      num_demos=cfg.num_demos, seed=cfg.seed, spec=TaskSpec(seed=cfg.seed))
    log(json.dumps({"warmup_loss_first": round(warm["first_loss"], 4),
                    "warmup_loss_final": round(warm["final_loss"], 4),
                    "warmup_s": round(warm["wall_s"], 1)}))
    out = rl_check(learner, cfg, log)
    out.update({"warmup_final_loss": warm["final_loss"], "warmup_s": warm["wall_s"],
                "wall_s": time.perf_counter() - t0, "config": dict(cfg.__dict__)})
    return out


def rl_check(learner: Learner, cfg: CheckConfig, log: Any = print) -> dict[str, Any]:
    """RL from a warmed-up learner (its weights, version and optimizer state) versus the
    lr = 0 control.

    The control is the same learner restored from `state_dict()` with lr = 0, stepped on
    the first RL batch: its weights stay bitwise equal to the warm-up weights (checked), so
    every later control batch would be sampled from those same weights, and its final
    evaluation is that of the warm-up weights on the same episodes and session ids (the
    sampler is deterministic)."""
    from cells.trainer.toy_task import TaskSpec, ToySampler, make_episodes

    task = TaskSpec(seed=cfg.seed)
    learner.set_reference()  # KL (when configured) anchors at the warmed-up policy
    learner.start_rl()  # the warm-up's moments describe another objective
    w0, v0 = learner.weights(), learner.version
    control = Learner(learner.spec, w0, lr=0.0, objective=learner.objective, tile=learner.tile)
    control.load_state_dict(learner.state_dict())
    control.lr = 0.0
    learner.lr = cfg.rl_lr
    sampler = ToySampler(learner.spec, w0, version=v0, row_tile=cfg.tile)
    # The engine falls back to single rows when its start-up probe fails: score as it does.
    learner.tile = control.tile = sampler.engine.tile
    try:
        evals = make_episodes(task, cfg.eval_episodes, start=10_000_000)
        t_eval = time.perf_counter()
        before = evaluate(sampler, evals, cfg.eval_samples, "eval-", cfg.max_turns)
        log(json.dumps({"warmup_eval": before, "eval_s": round(time.perf_counter() - t_eval, 1)}))
        t_rl = time.perf_counter()
        history = []
        for step in range(cfg.rl_steps):
            eps = make_episodes(task, cfg.groups, start=step * cfg.groups)
            trajs, _ = sampler.rollouts(eps, samples=cfg.samples, tag=f"rl{step}-",
                                        max_turns=cfg.max_turns)
            if step == 0:
                control_metrics = control.rl_step(trajs)
            m = learner.rl_step(trajs)
            sampler.load(learner.version, learner.weights())
            row = {"rl_step": step, "batch_reward": round(m["reward_mean"], 4),
                   "loss": round(m["loss"], 5), "bitwise": m["frac_bitwise_equal"],
                   "staleness": m["staleness_mean"], "tokens": m["num_tokens"],
                   "grad_norm": round(m["grad_norm"], 3), "step_s": round(m["step_s"], 2)}
            history.append(row)
            log(json.dumps(row))
        rl_s = time.perf_counter() - t_rl
        unchanged = all(torch.equal(control.params[k].detach(), w0[k]) for k in w0)
        after = evaluate(sampler, evals, cfg.eval_samples, "eval-", cfg.max_turns)
    finally:
        sampler.close()
    return {
        "warmup_reward": before["reward"],
        "control_reward": before["reward"],
        "rl_reward": after["reward"],
        "gain_over_control": after["reward"] - before["reward"],
        "warmup_solved": before["solved"],
        "rl_solved": after["solved"],
        "control_weights_unchanged": unchanged,
        "control_bitwise_first_step": control_metrics["frac_bitwise_equal"],
        "rl_s": rl_s,
        "history": history,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--selfcheck", action="store_true", help="run the learnability check")
    for f in CheckConfig.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    if not args.selfcheck:
        p.print_help()
        return
    cfg = CheckConfig(**{f: getattr(args, f) for f in CheckConfig.__dataclass_fields__})
    out = selfcheck(cfg)
    print(json.dumps({k: v for k, v in out.items() if k != "history"}, indent=1))
    if out["gain_over_control"] < 0.1 or not out["control_weights_unchanged"]:
        raise SystemExit("learnability check failed")


if __name__ == "__main__":
    main()

"""The learning core: fp32 parameters, AdamW, and the decoupled PPO step over stored trajectories.

Every sequence is scored by its own cache-free forward, `token_logprobs(prepare(spec, params),
ids, temperature, tile)` -- the function the cells' batch-invariant engine scores with, at the
same row tile -- so at the first update on a version sampled and scored in batch-invariant
mode lp_theta equals the cells' old log-probs bitwise (reported as `frac_bitwise_equal`).

One `rl_step` is one RL update (one published version) run in this process by
cells/rl/update.py -- the code the training cells run on their shares of the same plan
(cells/rl/plan.py): group-relative advantages per `group_id`, `minibatches` optimizer steps
with lp_prox from one detached forward at the start, the PPO-EWMA stand-in where old
log-probs are missing, KL to the reference when configured.

With restricted output ids each micro-batch's forward runs on a compacted vocabulary (a leaf
copy of the 151,936-row tables' touched rows, bitwise the full model's log-probs: autograd
through `index_select` would materialise a dense table gradient per use; cells/rl/vocab_rows.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from cells.engine.embedded.layers import rope_tables
from cells.engine.embedded.model import check_weights, prepare
from cells.engine.embedded.model_spec import ModelSpec
from cells.rl.batch import EXACT, MISSING  # noqa: F401  (re-exported)
from cells.rl.lr_schedule import LRSchedule
from cells.rl.objectives import PPOEWMA, ObjectiveConfig, SerializedTree
from cells.rl.objectives.config import ewma_window
from cells.rl.packing import sequence_logprobs
from cells.rl.plan import plan_update
from cells.rl.reduce import LocalReducer
from cells.rl.trees import tree_token_logprobs
from cells.rl.update import PROCESS_COMPUTE_S, run_update
from cells.rl.vocab_rows import EMBED, HEAD, VocabRows, id_ranges

STATE_FORMAT = 1

__all__ = ["EXACT", "MISSING", "Learner", "id_ranges"]
DEFAULT_STALENESS_BOUND = 8
"""The scheduler's default `staleness_bound`: the EWMA window's span when the objective names
none and the trainer has not resolved it from the scheduler's bound."""


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
        lr_schedule: str = "constant",
        lr_total_steps: int | None = None,
        lr_min_ratio: float = 0.1,
        sft_tile: int | None = None,
        version: int = 0,
        seed: int = 0,
        reference: dict[str, Tensor] | None = None,
        param_storage: Tensor | None = None,
    ) -> None:
        """`tile` must be the cells' row tile (batch-invariant mode) for bitwise old log-probs,
        `temperature` their sampling temperature; `output_ids` overrides the spec's output
        vocabulary; `reference` (the KL anchor) defaults to `weights`. `sft_tile` is the row
        tile of the warm-up forward: None runs the fast kernels (warm-up needs no bitwise
        match). `param_storage`: a 1-D float32 buffer the parameters live in, packed in name
        order (a training cell receives a joining state's parameters straight into it)."""
        if output_ids is not None:
            spec = replace(spec, output_id_ranges=id_ranges(output_ids))
        check_weights(spec, weights)
        self.spec = spec
        self.objective = objective or ObjectiveConfig()
        self.tile, self.temperature, self.max_grad_norm, self.micro_batch = tile, temperature, max_grad_norm, micro_batch
        self.minibatches = minibatches
        """Optimizer steps per RL update (k >= 2 lets the clip bind from the second; docs/RL.md)."""
        self.schedule = LRSchedule(lr_warmup_steps, lr_schedule, lr_total_steps, lr_min_ratio)
        """RL's learning-rate schedule (cells/rl/lr_schedule.py)."""
        self.rl_start_step: int | None = None
        """The optimizer step RL started at (`start_rl`); None: no RL learning-rate warm-up."""
        self.compute_s = {"forward": 0.0, "backward": 0.0}
        """Seconds this process spent in RL forwards and backwards (`run_update`)."""
        self.last_lr = float(lr)
        """The learning rate of the last optimizer step (after the warm-up's scaling)."""
        self.sft_tile = sft_tile
        self._init_state(weights, reference, lr, betas, weight_decay, param_storage)
        self.version = version
        """Version of the current parameters (what `weights()` publishes)."""
        self.step = 0
        """Optimizer steps taken."""
        self.cursor = 0
        """The caller's data cursor (e.g. the store's trajectory cursor); checkpointed."""
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        """The caller's RNG for data order (checkpointed)."""
        self._rope = rope_tables(spec.head_dim, spec.max_position, spec.rope_theta)
        self._vocab = VocabRows(spec)

    def _init_state(self, weights: dict[str, Tensor], reference: dict[str, Tensor] | None,
                    lr: float, betas: tuple[float, float], weight_decay: float,
                    storage: Tensor | None = None) -> None:
        """fp32 parameters, AdamW over them, the KL reference and the PPO-EWMA copy."""
        self.betas, self.weight_decay = betas, weight_decay
        self.compute_dtype: torch.dtype | None = None  # bf16 compute: cells/rl/precision.py
        self.pack = True  # a micro-batch's sequences in one forward (cells/rl/packing.py)
        self.checkpoint: bool | str = False  # activation checkpointing (cells/rl/precision.py)
        self._base_lr = float(lr)
        # Sorted names: the optimizer's state is indexed by position, checkpoints by name.
        self.params: dict[str, Tensor] = {}
        pos = 0
        for k in sorted(weights):
            w = weights[k].detach().to(torch.float32)
            if storage is None:
                self.params[k] = w.clone().requires_grad_(True)
                continue
            if storage.dtype != torch.float32 or storage.numel() < pos + w.numel():
                raise ValueError("param_storage must be float32 and hold every parameter")
            p = storage[pos: pos + w.numel()].view(w.shape)
            if p.data_ptr() != w.data_ptr():  # the weights may live there already
                p.copy_(w)
            self.params[k] = p.requires_grad_(True)
            pos += w.numel()
        # fused: one kernel over each tensor instead of a dozen passes (the step of a 152k-row
        # table dominated a CPU update); every rank runs the same one, so ranks stay equal.
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        self.reference: dict[str, Tensor] = {}
        self.set_reference(reference if reference is not None else weights)
        ew = self.objective.ewma
        self.ewma = PPOEWMA(self.params, staleness_window=ewma_window(ew, DEFAULT_STALENESS_BOUND, self.minibatches),
                            reset_threshold=ew.reset_threshold)

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
    def _logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool,
                  tile: int | None | str = "cells", entropy: list | None = None
                  ) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        """Per-token log-probs (index t = token t, 0 at t = 0) of each sequence, with the
        cells' row tile unless `tile` says otherwise; with `entropy` (a list) each sequence's
        per-token policy entropy (same layout, 0 at t = 0) is appended to it."""
        tile = self.tile if tile == "cells" else tile
        spec, w, rows, remapped = self._vocab.compact(weights, seqs, grad)
        with torch.set_grad_enabled(grad):
            prep = prepare(spec, w, self._rope, self.checkpoint, self.compute_dtype)
            out = sequence_logprobs(prep, remapped, self.temperature, tile, entropy, self.pack)
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
        self._vocab.add_grads(self.params, w, rows)

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
        t0 = time.perf_counter()
        try:
            return self._sft_step(batch)
        finally:
            PROCESS_COMPUTE_S["sft"] += time.perf_counter() - t0

    def _sft_step(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, float]:
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
        self.optimizer.zero_grad(set_to_none=True)  # an RL step leaves its gradients allocated
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
        self.update_ewma()
        return {"loss": total, "tokens": float(n_tok), "grad_norm": norm, "lr": self.lr,
                "version": float(self.version)}

    # -- the RL step -------------------------------------------------------------------------
    def start_rl(self) -> None:
        """RL begins here: the optimizer's moments from the warm-up are dropped (they describe
        another objective's gradients) and the learning-rate warm-up counts from this step.
        Versions restart here: the warmed-up weights are version 1 and each RL update adds one
        (the supervised steps before it are optimizer steps, not versions). The PPO-EWMA copy
        starts from the warmed-up weights (counted as a reset): it stands in for policies that
        sampled, and none sampled during the warm-up; its vocabulary rows then equal the
        parameters', so they stay off the wire when a training cell joins."""
        self.optimizer.state.clear()
        self.ewma.reset(self.params)
        self.rl_start_step = self.step
        self.version = 1

    def rl_step(self, trajectories: Sequence[dict[str, Any]], *, cursor: int | None = None,
                staleness_bound: int | None = None) -> dict[str, float]:
        """One RL update (`minibatches` optimizer steps, one published version) of the
        decoupled PPO objective over finished `trajectories` (the store's `to_api` format),
        computed in this process; returns the update's metrics. The cells of a training group
        run the same `run_update` on their shares of the same plan.

        Trajectories whose group has fewer than two members are dropped (their advantage is
        undefined; counted in `num_dropped`). `cursor`, when given, becomes the checkpointed
        data cursor. `staleness_bound`: sampled tokens older than that many versions before
        this update's start leave the loss (`mask_stale`)."""
        plan = plan_update(trajectories, self.objective, self.minibatches, [1.0], version=self.version,
                           staleness_bound=staleness_bound)
        metrics = run_update(self, plan.shares[0], LocalReducer())
        if cursor is not None:
            self.cursor = cursor
        metrics.update(plan.metrics())
        return metrics

    # -- what `run_update` calls ----------------------------------------------------------------
    def seq_logprobs(self, weights: dict[str, Tensor], seqs: Sequence[Tensor], grad: bool,
                     entropy: list | None = None) -> tuple[list[Tensor], dict[str, Tensor], Tensor | None]:
        """Per-token log-probs of `seqs` under `weights` at the cells' tile (see `_logprobs`)."""
        return self._logprobs(weights, seqs, grad, entropy=entropy)

    def tree_logprobs(self, weights: dict[str, Tensor], tree: SerializedTree, grad: bool
                      ) -> tuple[Tensor, dict[str, Tensor], Tensor | None]:
        """Per-token log-probs (L,) of a serialised rollout tree under `weights`, from one
        forward in which each node attends to its own path (cells/rl/trees.py); equal to
        each branch's own forward at the cells' tile."""
        spec, w, rows, (ids,) = self._vocab.compact(weights, [tree.token_ids], grad)
        with torch.set_grad_enabled(grad):
            prep = prepare(spec, w, self._rope, self.checkpoint, self.compute_dtype)
            lp = tree_token_logprobs(prep, tree, ids, self.temperature, self.tile)
        return lp, w, rows

    def zero_grads(self) -> dict[str, Tensor]:
        """Zero gradients for every parameter (a rank with no rows adds zeros to the sum), and
        the per-row marks of the vocabulary tables that `add_row_grads` fills."""
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:  # into the memory the last step used: no fresh pages to fault in
                p.grad.zero_()
        return self._vocab.row_marks(self.params)

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
        moved = {k: torch.nonzero((self.ewma.params[k] != self.params[k]).any(dim=1)).flatten()
                 for k in (EMBED, HEAD) if k in self.params and k in self.ewma.params}
        self.ewma.update(self.params, rows=moved)  # only those rows of the tables: the rest stay equal

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
        self.step += 1  # the gradients stay: the next `zero_grads` zeroes them where they are
        return norm

    def lr_scale(self) -> float:
        """The schedule's factor for the next optimizer step (1 outside RL)."""
        if self.rl_start_step is None:
            return 1.0
        return self.schedule.scale(self.step - self.rl_start_step + 1)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Parameters, reference, EWMA, optimizer, RNG, version and data cursor: tensors and
        JSON-able metadata only (written by cells/training/state_files.py: no pickle)."""
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

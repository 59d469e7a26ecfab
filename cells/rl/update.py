"""One RL update on one data-parallel rank: the same code for 1 rank (the learner alone) and for
the cells of a training group.

One line: detached forwards at the start (lp_prox, the EWMA stand-in, the reference) → per
sequence advantage (task advantage − beta·KL when the KL is in the reward) → per minibatch:
forward/backward on this rank's rows and trees → sum the gradients over the ranks → clip →
AdamW step → EWMA → sum the metrics → the trust-region guard (cells/rl/guard.py: an update
that moved the policy past `max_update_kl` is rolled back whole). One published version per
update, one optimizer step per minibatch. A forked episode is one tree
(cells/rl/tree_loss.py): one forward over its serialised tokens, the tree loss with one
advantage per branch.

Every rank applies the same summed gradient to the same state, so the states stay equal; the
loss of a minibatch is normalised by its global token count N0 (from the plan), so the sum
over ranks is the whole minibatch's loss whatever the split.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from cells.rl import guard, used_weights
from cells.rl.batch import Batch, pad
from cells.rl.objectives import (
    KLInReward,
    apply_correction,
    decoupled_ppo_loss,
    kl_reward_penalty,
    token_weights,
    update_kl_terms,
)
from cells.rl.objectives.custom import loss_metric_names
from cells.rl.objectives.ppo import agg_scale
from cells.rl.plan import Share, mask_stale
from cells.rl.reduce import Reducer, sum_gradients
from cells.rl.tree_loss import (
    approx_kl_sum,
    batch_counts,
    correction_sums,
    start_trees,
    tree_loss,
)
from scheduler.contract.failpoints import failpoint

# Per-minibatch sums reduced over the ranks; the reported means are rebuilt from them.
_COUNTS = ("num_tokens", "num_kept", "num_exact", "num_missing", "num_missing_kept", "num_missing_in_band")
_MEANS = {"kl": "num_kept", "mean_r_d": "num_exact", "mean_r_stale": "num_exact",
          "mean_r_d_missing": "num_missing", "mean_r_stale_missing": "num_missing",
          "mean_r_t": "num_kept", "mean_weight": "num_kept", "clip_frac": "num_kept",
          "dual_clip_frac": "num_kept", "frac_seq_rejected": "num_sequences"}
_SUMS = ("loss", "pg_loss", "kl_loss", "approx_kl_sum", "approx_kl_weight", "num_sequences", *_COUNTS, *_MEANS)


PROCESS_COMPUTE_S = {"rl": 0.0, "sft": 0.0}
"""Seconds of every update and supervised step this process ran, any learner's: the trainer
process reports it (it computes nothing: 0)."""


def run_update(learner: Any, share: Share, reducer: Reducer, snapshot: Any = None) -> dict[str, float]:
    """Apply one RL update (share.num_minibatches optimizer steps) to `learner` from this
    rank's `share`; every rank of `reducer` must call it with its share of the same plan.
    Returns the update's metrics summed over the ranks (equal on every rank). `snapshot`:
    the start-of-update state the caller already took (`guard.take`), which the guard reuses."""
    begin = getattr(learner, "begin_update", None)  # a sharded learner gathers its copies (collective)
    if begin is not None:
        begin()
    try:
        return _run_update(learner, share, reducer, snapshot)
    finally:
        if begin is not None:
            learner.end_update()


def _run_update(learner: Any, share: Share, reducer: Reducer, snapshot: Any = None) -> dict[str, float]:
    t0, start_version = time.perf_counter(), learner.version
    # the staleness bound, checked again here: the plan left no stale token in the loss
    _, stale = mask_stale(share.trajectories, learner.version, share.staleness_bound)
    if stale:
        raise ValueError(f"{stale} sampled tokens past the staleness bound {share.staleness_bound} of an "
                         f"update from version {learner.version} reached this rank")
    b = Batch.build(share.trajectories, learner.objective.tree) if share.trajectories else None
    pre = _start_of_update(learner, b, share)
    if hasattr(learner, "drop_gathered"):  # a sharded learner's whole reference / EWMA served the forwards
        learner.drop_gathered()
    learner.compute_s["forward"] += time.perf_counter() - t0
    bound = learner.objective.max_update_kl
    snap = (snapshot if snapshot is not None else guard.take(learner)) if bound is not None else None
    keys = sum_keys(learner.objective)
    totals = torch.zeros(len(keys), dtype=torch.float64)
    mb_losses, mb_sums, grad_norms = [], [], []
    stopped = False
    for j in range(share.num_minibatches):
        sums, norm = _minibatch(learner, b, pre, share, j, reducer, bound)
        mb_losses.append(sums[:3].clone())
        mb_sums.append(sums.clone())
        totals += sums
        if norm is None:  # the steps before this minibatch already moved the policy too far
            stopped = True
            break
        grad_norms.append(norm)
        failpoint("training.after_minibatch")  # a rank dying or stalling mid-update (fault campaign)
    # stopped: the KL the stopping minibatch measured (the update's, over its tokens)
    kl = (guard.minibatch_kl(dict(zip(_SUMS, mb_sums[-1].tolist()))) if stopped
          else guard.update_kl(learner, b, pre, reducer))
    rejected = snap is not None and (stopped or kl > bound)
    if rejected:  # the whole update, minibatches before the stop included, goes back
        guard.restore(learner, snap)
    else:
        learner.version += 1  # a rejected update publishes nothing: no new version
    out = _finish_metrics(keys, totals, mb_losses, list(share.n0[: len(mb_losses)]))
    out.update({"update_kl": kl, "update_rejected": float(rejected), "minibatches_run": float(len(grad_norms))})
    clip = [float(x[_SUMS.index("clip_frac")] / max(float(x[_SUMS.index("num_kept")]), 1.0)) for x in mb_sums]
    out["clip_frac_first"] = clip[0]
    out["clip_frac_after_first"] = sum(clip[1:]) / len(clip[1:]) if len(clip) > 1 else 0.0
    out.update(_batch_metrics(b, pre, reducer, start_version))  # staleness against the update's start
    learner.used_weights = used_weights.per_trajectory(b, pre, share.trajectories)  # written back
    out.update({"grad_norm": grad_norms[-1] if grad_norms else 0.0, "grad_norm_max": max(grad_norms, default=0.0),
                "lr": learner.lr,
                "lr_effective": learner.last_lr,
                "ewma_resets": float(learner.ewma.num_resets), "version": float(learner.version),
                "optimizer_step": float(learner.step), "train_ranks": float(reducer.world),
                "step_s": time.perf_counter() - t0})
    PROCESS_COMPUTE_S["rl"] += out["step_s"]
    return out


def sum_keys(objective: Any) -> tuple[str, ...]:
    """The per-minibatch sums reduced over the ranks: the built-in ones, then a custom loss's
    declared metrics (the same layout on every rank)."""
    return _SUMS + loss_metric_names(objective.loss)


def _start_of_update(learner: Any, b: Batch | None, share: Share) -> dict[str, Any]:
    """The detached per-token tensors of the update, from forwards at its start: rows padded
    (B, T), trees in `pre["trees"]`."""
    if b is None:
        return {"trees": []}
    cfg = learner.objective
    trees = start_trees(learner, b.trees, share.advantages, share.minibatch)
    if b.size == 0:
        return {"trees": trees, "mb": torch.zeros(0, dtype=torch.long)}
    ent: list[Tensor] = []
    lp_prox = pad(learner.seq_logprobs(learner.params, b.ids, False, entropy=ent)[0], b.length, 0.0)
    lp_stand = torch.zeros_like(b.behav)
    need = [i for i in range(b.size) if bool(b.missing[i].any())]
    if need:
        stand, _, _ = learner.seq_logprobs(learner.ewma.params, [b.ids[i] for i in need], False)
        for i, lp in zip(need, stand):
            lp_stand[i, : len(lp)] = lp
    lp_ref = None
    if cfg.kl is not None:
        lp_ref = pad(learner.seq_logprobs(learner.reference, b.ids, False)[0], b.length, 0.0)
    adv_traj = torch.tensor(share.advantages, dtype=torch.float32)
    if isinstance(cfg.kl, KLInReward):
        # after the group normalisation of the task reward: KL noise never passes through the
        # group std (docs/RL.md, advantages)
        w = token_weights(lp_prox, b.behav, b.mask, cfg, lp_old=b.old, provenance=b.missing,
                          lp_stand=lp_stand).weight
        pen = kl_reward_penalty(lp_prox, lp_ref, w, b.mask, coef=cfg.kl.coef, estimator=cfg.kl.estimator)
        adv_traj = adv_traj - torch.zeros_like(adv_traj).index_add_(0, b.traj, pen.to(adv_traj.dtype))
    mb = torch.tensor(share.minibatch, dtype=torch.long)[b.traj]
    # each row's sequence (its trajectory) and the sequence's tokens in the loss
    per_traj = torch.zeros(len(share.trajectories), dtype=torch.float32).index_add_(
        0, b.traj, b.mask.sum(1).to(torch.float32))
    return {"lp_prox": lp_prox, "lp_stand": lp_stand, "lp_ref": lp_ref, "adv": adv_traj[b.traj], "mb": mb,
            "trees": trees, "entropy": pad(ent, b.length, 0.0), "seq_len": per_traj[b.traj],
            "behind": torch.where(b.mask, learner.version - b.versions, -1)}


def _rows(b: Batch | None, pre: dict, j: int) -> list[int]:
    return [] if b is None else torch.nonzero(pre["mb"] == j).flatten().tolist()


def _chunks(rows: list[int], b: Batch, size: int, whole: bool) -> list[list[int]]:
    """Micro-batches of `rows`; with `whole`, a trajectory's rows are never split (a sequence
    ratio is taken over all of them at once)."""
    if not whole:
        return [rows[lo: lo + size] for lo in range(0, len(rows), size)]
    out: list[list[int]] = [[]]
    for i, r in enumerate(rows):
        if len(out[-1]) >= size and int(b.traj[r]) != int(b.traj[rows[i - 1]]):
            out.append([])
        out[-1].append(r)
    return [c for c in out if c]


def _trees(pre: dict, j: int) -> list[int]:
    """Indices of the trees of minibatch j."""
    return [i for i, s in enumerate(pre["trees"]) if s.minibatch == j]


def _normalizer(learner: Any, b: Batch | None, pre: dict, rows: list[int], trees: list[int],
                reducer: Reducer) -> Tensor | None:
    """The minibatch-wide mean of the kept correction weights (self-normalisation), over all
    ranks; it depends only on the anchors and the behaviour log-probs."""
    cfg = learner.objective
    if not cfg.self_normalize:
        return None
    acc = torch.zeros(2, dtype=torch.float64)
    if rows:
        idx = torch.tensor(rows)
        anchor = torch.where(b.missing[idx], pre["lp_stand"][idx], b.old[idx])
        corr = apply_correction(torch.where(b.mask[idx], anchor - b.behav[idx], 0.0), b.mask[idx],
                                cfg.correction, reject_below=cfg.reject_below)
        acc += torch.stack([corr.weight.sum(), corr.keep.sum()]).to(torch.float64)
    for i in trees:
        acc += correction_sums(cfg, b.trees[i], pre["trees"][i])
    reducer.all_reduce(acc)
    return (acc[0] / acc[1]).to(torch.float32) if acc[1] > 0 else torch.tensor(1.0)


def _minibatch(learner: Any, b: Batch | None, pre: dict, share: Share, j: int, reducer: Reducer,
               bound: float | None = None) -> tuple[Tensor, float | None]:
    """Forward/backward of this rank's rows and trees of minibatch j, the summed gradient applied
    as one optimizer step; returns the minibatch's metric sums over all ranks and the grad norm,
    or None for the norm when its forward shows the policy already past `bound` (no step)."""
    cfg, rows, trees = learner.objective, _rows(b, pre, j), _trees(pre, j)
    normalizer = _normalizer(learner, b, pre, rows, trees, reducer)
    used_weights.keep(learner, b, pre, rows, trees, normalizer)  # the w_t the loss below multiplies by
    n0 = torch.tensor(float(max(share.n0[j], 1)))
    s0 = share.s0[j] if share.s0 else 0
    touched = learner.zero_grads()
    lt_rows, lt_trees, done_rows = [], [], []
    for chunk in _chunks(rows, b, learner.micro_batch, cfg.ratio == "sequence"):
        idx = torch.tensor(chunk)
        t0 = time.perf_counter()
        lps, w, vocab_rows = learner.seq_logprobs(learner.params, [b.ids[i] for i in chunk], True)
        lt = pad(lps, b.length, 0.0)
        loss, _ = decoupled_ppo_loss(lt, pre["lp_prox"][idx], b.behav[idx], pre["adv"][idx], b.mask[idx], cfg,
                                     **_extra(b, pre, idx), num_tokens=n0, normalizer=normalizer,
                                     token_scale=agg_scale(cfg, pre["seq_len"][idx], s0), seq_index=b.traj[idx])
        _backward(learner, loss, w, vocab_rows, touched, t0)
        lt_rows.append(lt.detach())
        done_rows += chunk
    for i in trees:
        t0 = time.perf_counter()
        lt, w, vocab_rows = learner.tree_logprobs(learner.params, b.trees[i].ser, True)
        loss, _ = tree_loss(learner, b.trees[i], pre["trees"][i], lt, n0, normalizer, s0)
        _backward(learner, loss, w, vocab_rows, touched, t0)
        lt_trees.append(lt.detach())
    join = getattr(learner, "join_forwards", None)  # a gathered learner's cell ends its forwards together
    if join is not None:
        join()
    sums = _local_sums(learner, b, pre, done_rows, lt_rows, n0, normalizer, s0)
    sums += _tree_sums(learner, b, pre, trees, lt_trees, n0, normalizer, s0)
    reducer.all_reduce(sums)
    m = dict(zip(sum_keys(learner.objective), sums.tolist()))
    if bound is not None and j > 0 and guard.minibatch_kl(m) > bound:  # equal on every rank
        return sums, None
    reduce_gradients(learner, reducer, touched)
    norm = learner.apply_gradients()
    if learner.ewma.should_reset(m["num_missing_in_band"], m["num_missing"]):  # the band rule (docs/RL.md)
        learner.ewma.reset(learner.params)
    else:
        learner.update_ewma()
    return sums, norm


def reduce_gradients(learner: Any, reducer: Reducer, touched: dict[str, Tensor]) -> None:
    """The gradient sum over the step's ranks: the learner's own where its state is sharded
    (cells/rl/shard.py), else one all-reduce (in the compute dtype: bf16 on the wire)."""
    own = getattr(learner, "reduce_gradients", None)
    if own is not None:
        own(reducer, touched)
    else:
        sum_gradients(reducer, learner.params, touched, getattr(learner, "compute_dtype", None))


def _backward(learner: Any, loss: Tensor, w: dict[str, Tensor], vocab_rows: Tensor | None,
              touched: dict[str, Tensor], t0: float) -> None:
    t1 = time.perf_counter()
    loss.backward()
    learner.compute_s["forward"] += t1 - t0
    learner.compute_s["backward"] += time.perf_counter() - t1
    learner.add_row_grads(w, vocab_rows, touched)


def _extra(b: Batch, pre: dict, idx: Tensor) -> dict[str, Any]:
    return {"lp_old": b.old[idx], "provenance": b.missing[idx], "lp_stand": pre["lp_stand"][idx],
            "lp_ref": None if pre["lp_ref"] is None else pre["lp_ref"][idx], "versions_behind": pre["behind"][idx]}


@torch.no_grad()
def _local_sums(learner: Any, b: Batch | None, pre: dict, rows: list[int], lt_rows: list[Tensor],
                n0: Tensor, normalizer: Tensor | None, s0: int = 0) -> Tensor:
    """This rank's rows' contribution to minibatch j's metric sums (no forward: the log-probs
    of the backward pass are kept)."""
    if not rows:
        return torch.zeros(len(sum_keys(learner.objective)), dtype=torch.float64)
    idx = torch.tensor(rows)
    lt = torch.cat(lt_rows)
    _, m = decoupled_ppo_loss(lt, pre["lp_prox"][idx], b.behav[idx], pre["adv"][idx], b.mask[idx],
                              learner.objective, **_extra(b, pre, idx), num_tokens=n0, normalizer=normalizer,
                              token_scale=agg_scale(learner.objective, pre["seq_len"][idx], s0),
                              seq_index=b.traj[idx])
    # KL(pi_prox || this step's pi), the importance-weighted k3 (cells/rl/objectives/kl.py)
    kl = update_kl_terms(pre["lp_prox"][idx], lt, b.behav[idx], b.mask[idx], learner.objective.update_kl_is_cap)
    return _as_sums(sum_keys(learner.objective), m, len(rows), kl)


@torch.no_grad()
def _tree_sums(learner: Any, b: Batch | None, pre: dict, trees: list[int], lt_trees: list[Tensor],
               n0: Tensor, normalizer: Tensor | None, s0: int = 0) -> Tensor:
    """This rank's trees' contribution to minibatch j's metric sums ((branch, token) pairs)."""
    keys = sum_keys(learner.objective)
    out = torch.zeros(len(keys), dtype=torch.float64)
    for i, lt in zip(trees, lt_trees):
        u, s = b.trees[i], pre["trees"][i]
        _, m = tree_loss(learner, u, s, lt, n0, normalizer, s0)
        out += _as_sums(keys, m, u.num_branches, approx_kl_sum(u, s, lt, learner.objective.update_kl_is_cap))
    return out


def _as_sums(keys: tuple[str, ...], m: dict[str, float], num_sequences: int,
             approx_kl: tuple[float, float]) -> Tensor:
    """A loss's metrics as the sums `keys` (means times their counts)."""
    m = {**m, "num_sequences": float(num_sequences), "approx_kl_sum": approx_kl[0], "approx_kl_weight": approx_kl[1]}
    for k, d in _MEANS.items():
        m[k] = m[k] * m[d]
    return torch.tensor([float(m[k]) for k in keys], dtype=torch.float64)


def _finish_metrics(keys: tuple[str, ...], totals: Tensor, mb_losses: list[Tensor], n0: list[int]) -> dict[str, float]:
    """Means from the summed metrics; the loss terms are those of the whole batch at the
    start of each minibatch, weighted by its tokens."""
    m = dict(zip(keys, totals.tolist()))
    weights = [n / max(sum(n0), 1) for n in n0]
    for i, k in enumerate(("loss", "pg_loss", "kl_loss")):
        m[k] = sum(float(x[i]) * w for x, w in zip(mb_losses, weights))
    for k, d in _MEANS.items():
        m[k] = m[k] / m[d] if m[d] else 0.0
    m["frac_masked"] = 1.0 - m["num_kept"] / m["num_tokens"] if m["num_tokens"] else 0.0
    m["frac_missing_kept"] = m["num_missing_kept"] / m["num_missing"] if m["num_missing"] else 1.0
    weight = m.pop("approx_kl_weight")
    m["approx_kl"] = m.pop("approx_kl_sum") / weight if weight else 0.0
    return m


def _batch_metrics(b: Batch | None, pre: dict, reducer: Reducer, version: int) -> dict[str, float]:
    """Provenance counts, staleness against the update's version, and how many exact old
    log-probs lp_prox reproduces bitwise, over all ranks (a tree's tokens counted once)."""
    s = torch.zeros(11, dtype=torch.float64)
    mx = torch.full((1,), -1e9, dtype=torch.float64)
    if b is not None and b.size:
        exact = b.mask & ~b.missing
        stale = (version - b.versions)[b.mask].to(torch.float64)
        s += torch.tensor([float(exact.sum()), float((b.missing & ~b.unscored).sum()), float(b.unscored.sum()),
                           float(stale.sum()), float(stale.numel()),
                           float((pre["lp_prox"] == b.old)[exact].sum()),
                           float(pre["adv"].abs().sum()), float(b.size), 0.0, 0.0,
                           float(pre["entropy"][b.mask].sum())], dtype=torch.float64)
        if stale.numel():
            mx[0] = stale.max()
    for u, st in zip(b.trees if b is not None else [], pre["trees"]):
        counts, most = batch_counts(u, st, version)
        s += torch.cat([counts, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)])
        mx[0] = max(float(mx[0]), most)
    if b is not None:
        s[9] += b.num_unrolled
    reducer.all_reduce(s)
    reducer.all_reduce(mx, "max")
    exact_n, n = s[0].item(), s[4].item()
    return {"tokens_exact": exact_n, "tokens_missing": s[1].item(), "tokens_unscored": s[2].item(),
            "staleness_mean": s[3].item() / n if n else 0.0, "staleness_max": mx.item() if n else 0.0,
            "frac_bitwise_equal": s[5].item() / exact_n if exact_n else float("nan"),
            "adv_seq_abs_mean": s[6].item() / s[7].item() if s[7].item() else 0.0,
            "num_trees": s[8].item(), "num_trees_unrolled": s[9].item(),
            # the policy's entropy at the update's start, over the sampled tokens of rows
            "entropy_mean": s[10].item() / rows_n if (rows_n := _row_tokens(b, reducer)) else 0.0}


def _row_tokens(b: Batch | None, reducer: Reducer) -> float:
    """Sampled tokens of the rows (trees apart), over all ranks."""
    n = torch.tensor([float(b.mask.sum()) if b is not None and b.size else 0.0], dtype=torch.float64)
    reducer.all_reduce(n)
    return n.item()

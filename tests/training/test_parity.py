"""The update does not depend on how many cells train: 1, 2 and 3 training ranks with the batch
split unevenly (token shares 1:2:5) give the same parameters after 3 RL updates (grad-norm
clipping on, the e2e learning rate) up to the float reduction order; the same membership and
split twice give the same bits; one cell gives the bits of one process's own update (`Learner.rl_step`)."""

from __future__ import annotations

import pytest
import torch

from cells.rl.objectives import ObjectiveConfig
from tests.training.cluster import (
    Ranks,
    committed_params,
    coordinator,
    learner,
    rel_diff,
    trajectories,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

SHARES = [1.0, 2.0, 5.0]


def _run(ranks: Ranks, cells: list[str], batches: list[list[dict]], objective: ObjectiveConfig | None = None,
         lost_ok: bool = False) -> tuple[dict, list[dict]]:
    lrn = learner(max_grad_norm=1.0, **({"objective": objective} if objective else {}))
    coord = coordinator(lrn, ranks.host.address)
    metrics = []
    for b in batches:
        metrics.append(coord.update(b, cells, shares=SHARES[: len(cells)], next_version=lambda: coord.version + 1))
    if not lost_ok:
        assert all(m["train_cells"] == len(cells) for m in metrics), metrics
    return committed_params(coord, ranks.tmp / f"ckpt-{ranks.runs()}"), metrics


def test_one_two_three_cells_give_the_same_update(tmp_path):
    base = learner()
    theta0 = {k: p.detach().clone() for k, p in base.params.items()}
    batches = [trajectories(base, seed=s) for s in range(3)]
    local = learner(max_grad_norm=1.0)
    for b in batches:
        local.rl_step(b)
    ranks = Ranks(tmp_path, 3)
    try:
        one, m1 = _run(ranks, ["cell-0"], batches)
        two, m2 = _run(ranks, ["cell-0", "cell-1"], batches)
        three, m3 = _run(ranks, ["cell-0", "cell-1", "cell-2"], batches)
        two_again, _ = _run(ranks, ["cell-0", "cell-1"], batches)
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    for k in one:  # one rank runs exactly the coordinator's own code on the whole batch
        assert torch.equal(one[k], local.params[k].detach())
        assert torch.equal(two[k], two_again[k])
    d = {"1-2": rel_diff(one, two, theta0), "1-3": rel_diff(one, three, theta0), "2-3": rel_diff(two, three, theta0)}
    assert max(d.values()) <= 1e-3, d
    print("param_max_rel_diff", d)
    for a, b in zip(m1, m3):  # the same update, so the same token counts and (nearly) losses
        assert a["num_tokens"] == b["num_tokens"] and a["num_minibatches"] == b["num_minibatches"] == 2
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert [m["version"] for m in m2] == [1.0, 2.0, 3.0]
    assert [m["optimizer_step"] for m in m2] == [2.0, 4.0, 6.0]  # two minibatch steps per version
    # the start state built by each rank once (the coordinator holds none), then kept
    assert m1[0]["join_cells"] == 1 and m1[0]["join_source"] == "build" and m1[1]["join_cells"] == 0


CUSTOM = "cells.rl.objectives.custom:reinforce_with_weights"
VARIANTS = {
    "gspo_seq_mean": ObjectiveConfig(ratio="sequence", loss_agg="seq_mean_token_mean", clip_low=0.01, clip_high=0.01),
    "dr_grpo_custom": ObjectiveConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_constant=16.0,
                                      advantage_norm="none", loss=CUSTOM),
}


def test_loss_variants_and_a_custom_loss_add_up_across_ranks(tmp_path):
    """The sequence-level sums (S over all ranks, a trajectory's ratio on the rank that holds
    it) and a custom loss's metric sums: 1 rank gives the coordinator's own bits, 2 ranks the
    same update; a rank whose configuration does not name the custom loss refuses the step
    before joining, and the step goes on without it."""
    base = learner()
    theta0 = {k: p.detach().clone() for k, p in base.params.items()}
    batches = [trajectories(base, seed=s) for s in range(2)]
    ranks = Ranks(tmp_path, 3, args={0: ["--loss", CUSTOM], 1: ["--loss", CUSTOM]})
    try:
        for name, obj in VARIANTS.items():
            local = learner(max_grad_norm=1.0, objective=obj)
            lm = [local.rl_step(b) for b in batches]
            one, m1 = _run(ranks, ["cell-0"], batches, obj)
            two, m2 = _run(ranks, ["cell-0", "cell-1"], batches, obj)
            for k in one:
                assert torch.equal(one[k], local.params[k].detach()), (name, k)
            assert rel_diff(one, two, theta0) <= 1e-3, name
            for a, b, c in zip(lm, m1, m2):
                assert a["loss"] == pytest.approx(c["loss"], rel=1e-4, abs=1e-7) and a["loss"] == b["loss"], name
                if obj.loss:  # counts: exact whatever the split
                    assert a["loss_negative_tokens"] == b["loss_negative_tokens"] == c["loss_negative_tokens"] > 0
        refused, mr = _run(ranks, ["cell-1", "cell-2"], batches, VARIANTS["dr_grpo_custom"], lost_ok=True)
    except Exception:
        print(ranks.logs())
        raise
    finally:
        ranks.stop()
    print([(m["cells_lost"], m["train_cells"], m["attempts"]) for m in mr])
    assert all(m["cells_lost"] == 1.0 and m["train_cells"] == 1.0 for m in mr), mr
    assert all(torch.equal(refused[k], one[k]) for k in one)  # cell-1 alone: the 1-rank bits
    assert "refusing training step" in (tmp_path / "cell-2.log").read_text()

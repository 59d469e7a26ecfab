"""An update's figures reach the scheduler's Prometheus metrics: KL, grad norm, clip fraction,
the policy's entropy at the sampled tokens, the outcome, and the trained tokens by versions
behind (the staleness histogram)."""

from __future__ import annotations

import math

import pytest
import torch

from cells.trainer.trainer import update_figures
from tests.scheduler.sched_fakes import Harness
from tests.trainer.test_learner import BAD, GOOD, PROMPT, small_learner, trajectory
from tests.trainer.test_update_kl import _full_logprobs

torch.set_num_threads(1)


def test_the_staleness_histogram_counts_trained_tokens_by_versions_behind():
    batch = [{"loss_mask": [0, 1, 1, 1], "versions": [None, 9, 10, 10]},
             {"loss_mask": [0, 1, 1], "versions": [None, 6, 8]}]
    u = update_figures({"update_kl": 0.1, "grad_norm": 2.0, "clip_frac": 0.25, "entropy_mean": 1.5,
                        "update_rejected": 0.0}, batch, start_version=10, bound=2)
    assert u["staleness"] == [2, 1, 1]  # 10,10 | 9 | 8; the token 4 behind is past the bound
    assert update_figures({}, batch, 10, None)["staleness"] == [2, 1, 1, 0, 1]


def test_the_entropy_is_the_policys_at_the_sampled_tokens():
    learner = small_learner(minibatches=1)
    t = trajectory(learner, PROMPT, GOOD, 1.0, sid="a")
    m = learner.rl_step([t, trajectory(learner, PROMPT, BAD, 0.0, sid="b")])
    # by hand, before the update: entropy of each position that predicts a sampled token
    fresh = small_learner(minibatches=1)
    ent = []
    for ids in (PROMPT + GOOD, PROMPT + BAD):
        lp = _full_logprobs(fresh.params, ids)
        h = -(lp.exp() * lp).sum(-1)
        ent += h[len(PROMPT) - 1:].tolist()  # row i predicts token i + 1: the sampled ones
    assert m["entropy_mean"] == pytest.approx(sum(ent) / len(ent), rel=1e-4)
    assert 0 < m["entropy_mean"] < math.log(_full_logprobs(fresh.params, PROMPT).shape[-1])


def test_a_trainer_report_sets_the_training_metrics(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    try:
        body = {"batch_size": 8, "steps_in_progress": 0, "max_cells_per_step": 2, "step_s": 3.0, "sessions": 8,
                "cells": 2, "update": {"update_kl": 0.04, "grad_norm": 1.5, "clip_frac": 0.1, "entropy": 2.25,
                                       "staleness": [5, 3, 0, 1]}}
        assert h.client.post("/v1/trainer/report", json=body).status_code == 200
        text = h.client.get("/metrics").text
        for line in ("cellflip_training_update_kl 0.04", "cellflip_training_entropy 2.25",
                     "cellflip_training_clip_fraction 0.1", 'cellflip_training_updates_total{outcome="kept"} 1.0',
                     'cellflip_trained_tokens_total{versions_behind="0"} 5.0',
                     'cellflip_trained_tokens_total{versions_behind="3"} 1.0'):
            assert line in text, line
        bad = {**body, "update": {**body["update"], "staleness": [-1]}}  # a count is never negative
        assert h.client.post("/v1/trainer/report", json=bad).status_code == 422
        assert h.client.get("/metrics").text.count('cellflip_training_updates_total{outcome="kept"} 1.0') == 1
    finally:
        h.close()

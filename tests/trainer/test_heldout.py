"""The held-out evaluation set: disjoint from training and warm-up episodes; greedy scoring is
deterministic for given weights."""

from __future__ import annotations

import torch

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.trainer.toy_task import HELDOUT_START, TaskSpec, heldout_episodes, heldout_eval

torch.set_num_threads(1)


def test_heldout_episodes_are_fixed_and_outside_training_and_demos():
    spec = TaskSpec(seed=0)
    eps = heldout_episodes(spec, 4)
    assert [e.episode_id for e in eps] == [e.episode_id for e in heldout_episodes(spec, 4)]
    assert HELDOUT_START >= 2_000_000  # demos come from [1_000_000, 2_000_000), agents from 0


def test_greedy_heldout_score_is_deterministic():
    spec = PRESETS["toy"]
    w = init_weights(spec, 0, 0.1)
    a = heldout_eval(spec, w, TaskSpec(seed=0), 4)
    assert a == heldout_eval(spec, w, TaskSpec(seed=0), 4)
    assert 0.0 <= a["reward"] <= 1.0 and 0.0 <= a["solved"] <= 1.0

"""GRPO and RLOO on hand numbers; groups of size < 2 and bad shapes raise."""

import math

import pytest
import torch

from cells.rl.objectives.advantages import (
    compute_advantages,
    expand_to_tokens,
    grpo_advantages,
    rloo_advantages,
)
from cells.rl.objectives.config import GRPOAdvantage, RLOOAdvantage

torch.set_num_threads(1)

F64 = torch.float64


def test_grpo_hand_numbers():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]], dtype=F64)
    adv = grpo_advantages(rewards, eps=1e-6)
    # group 0: mean 2, Bessel std 1; group 1: std 0 -> A = 0
    torch.testing.assert_close(adv[0], torch.tensor([-1.0, 0.0, 1.0], dtype=F64) / (1 + 1e-6))
    torch.testing.assert_close(adv[1], torch.zeros(3, dtype=F64))
    binary = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64), eps=0.0)
    # mean 0.5, Bessel std sqrt(1/3) (the population std would give ±1)
    torch.testing.assert_close(
        binary, torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=F64) * 0.5 * math.sqrt(3)
    )


def test_rloo_hand_numbers():
    adv = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0]], dtype=F64))
    # A_1 = 1 − (2+3)/2, A_2 = 2 − (1+3)/2, A_3 = 3 − (1+2)/2
    torch.testing.assert_close(adv, torch.tensor([[-1.5, 0.0, 1.5]], dtype=F64))
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([[0.0, 1.0]])), torch.tensor([[-1.0, 1.0]])
    )


def test_flat_rewards_with_uneven_groups():
    rewards = torch.tensor([1.0, 7.0, 2.0, 3.0, 9.0], dtype=F64)
    groups = torch.tensor([0, 1, 0, 0, 1])
    torch.testing.assert_close(
        rloo_advantages(rewards, groups), torch.tensor([-1.5, -2.0, 0.0, 1.5, 2.0], dtype=F64)
    )
    std1 = math.sqrt(2.0)  # group 1: rewards 7, 9
    torch.testing.assert_close(
        grpo_advantages(rewards, groups, eps=0.0),
        torch.tensor([-1.0, -1 / std1, 0.0, 1.0, 1 / std1], dtype=F64),
    )
    torch.testing.assert_close(
        compute_advantages(rewards, RLOOAdvantage(), groups), rloo_advantages(rewards, groups)
    )
    torch.testing.assert_close(
        compute_advantages(rewards, GRPOAdvantage(eps=0.0), groups),
        grpo_advantages(rewards, groups, eps=0.0),
    )


def test_groups_need_two_responses():
    with pytest.raises(ValueError, match="n >= 2"):
        grpo_advantages(torch.tensor([[1.0], [2.0]]))
    with pytest.raises(ValueError, match=r"n >= 2.*\[1\]"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


def test_bad_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="both be"):
        rloo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="must be"):
        expand_to_tokens(torch.zeros(3), torch.ones(2, 4))


def test_expand_to_tokens():
    out = expand_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]

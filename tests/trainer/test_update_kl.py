"""How far an update moved the policy: the k3 estimate of KL(π_prox ‖ π_new) the right way up,
reweighted from π_behav's samples to π_prox, against the exact KL over the whole vocabulary of
a small model before and after one update."""

from __future__ import annotations

import math

import torch

from cells.engine.embedded.model import Segment, forward, output_logprobs, prepare
from cells.rl.objectives import update_kl_terms
from tests.trainer.test_learner import BAD, GOOD, PROMPT, SMALL, small_learner, trajectory

torch.set_num_threads(1)


def _full_logprobs(params: dict, ids: list[int]) -> torch.Tensor:
    """log π(· | ids[:t+1]) over the whole output vocabulary at every position, [L-1, V]."""
    prep = prepare(SMALL, {k: v.detach() for k, v in params.items()})
    x = torch.tensor(ids)
    hidden = forward(prep, x, torch.arange(len(ids)), [Segment(0, len(ids), 0)], None)
    return output_logprobs(prep, hidden[:-1], 1.0, None)


def _enumerated(lp_prox: torch.Tensor, lp_new: torch.Tensor, cap: float = 1e9) -> float:
    """The estimator applied to every token of the vocabulary once, as if drawn uniformly: the
    importance weights π_prox/uniform then make its weighted mean the exact expectation over π_prox."""
    uniform = torch.full_like(lp_prox, -math.log(lp_prox.shape[-1]))
    mask = torch.ones_like(lp_prox, dtype=torch.bool)
    s, w = update_kl_terms(lp_prox, lp_new, uniform, mask, cap)
    return s / w


def test_the_estimate_is_the_exact_kl_of_pi_prox_to_pi_new_on_a_small_categorical():
    g = torch.Generator().manual_seed(0)
    prox = torch.log_softmax(torch.randn(4, 50, generator=g), -1)
    new = torch.log_softmax(prox + 1.5 * torch.randn(4, 50, generator=g), -1)  # a large step
    exact = float((prox.exp() * (prox - new)).sum(-1).mean())
    assert abs(_enumerated(prox, new) - exact) < 1e-4 * max(1.0, exact)  # every row weighs the same
    # negative control: the inverse ratio (the old formula) estimates chi2 - KL, far off for this step
    log_r = prox - new
    inverse = float((prox.exp() * (log_r.exp() - 1 - log_r)).sum(-1).mean())
    assert abs(inverse - exact) > 0.5 * exact


def test_against_the_exact_kl_of_a_small_model_before_and_after_one_update():
    learner = small_learner(lr=5e-2, minibatches=2)
    ids = PROMPT + GOOD
    before = {k: v.detach().clone() for k, v in learner.params.items()}
    learner.rl_step([trajectory(learner, PROMPT, GOOD, 5.0, sid="a"), trajectory(learner, PROMPT, BAD, -5.0, sid="b"),
                     trajectory(learner, PROMPT, GOOD[:2] + BAD[2:], 5.0, sid="c"),
                     trajectory(learner, PROMPT, BAD[:2] + GOOD[2:], -5.0, sid="d")])
    prox, new = _full_logprobs(before, ids), _full_logprobs(learner.params, ids)
    exact = (prox.exp() * (prox - new)).sum(-1)  # KL(π_prox ‖ π_new) at each position
    assert float(exact.mean()) > 1e-3  # the update moved the policy
    per_position = [_enumerated(prox[t: t + 1], new[t: t + 1]) for t in range(prox.shape[0])]
    assert torch.allclose(torch.tensor(per_position), exact.to(torch.float32), rtol=1e-3, atol=1e-6)


def test_samples_from_another_policy_are_reweighted_to_pi_prox():
    """Many tokens drawn from π_behav ≠ π_prox: the truncated-IS mean approaches the exact KL;
    unweighted, it estimates the KL under the wrong distribution."""
    g = torch.Generator().manual_seed(1)
    prox = torch.log_softmax(torch.randn(1, 20, generator=g), -1)[0]
    behav = torch.log_softmax(prox + 0.5 * torch.randn(20, generator=g), -1)
    new = torch.log_softmax(prox + 0.8 * torch.randn(20, generator=g), -1)
    exact = float((prox.exp() * (prox - new)).sum())
    x = torch.multinomial(behav.exp(), 200_000, replacement=True, generator=g)
    s, w = update_kl_terms(prox[x], new[x], behav[x], torch.ones_like(x, dtype=torch.bool), cap=50.0)
    assert abs(s / w - exact) < 0.05 * exact
    s1, w1 = update_kl_terms(prox[x], new[x], prox[x], torch.ones_like(x, dtype=torch.bool), cap=50.0)  # no weights
    behav_kl = float((behav.exp() * ((new - prox).exp() - 1 - (new - prox))).sum())
    assert abs(s1 / w1 - behav_kl) < 0.05 * behav_kl and abs(behav_kl - exact) > 0.1 * exact

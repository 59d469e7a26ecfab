"""`trainer.precision: bf16`: bf16 forwards and gradient sums over fp32 master state."""

import pytest
import torch

from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.learner import Learner
from cells.rl.objectives import ObjectiveConfig
from cells.rl.precision import set_checkpointing, set_precision
from cells.rl.reduce import sum_gradients
from scheduler.contract.config.trainer import TrainerConfig

SPEC = PRESETS["toy"]


def _batch():
    ids = SPEC.output_ids()
    out = []
    for g in range(2):
        prompt = [ids[(5 * g + j) % len(ids)] for j in range(9)]
        for i in range(4):
            comp = [ids[(3 * i + 7 * j + g) % len(ids)] for j in range(6 + i)]
            m = [0] * len(prompt) + [1] * len(comp)
            out.append({"id": f"t{g}{i}", "group_id": f"g{g}", "reward": float(i % 2), "segment_starts": [0],
                        "token_ids": prompt + comp, "loss_mask": m,
                        "logprobs": [-3.0 if x else None for x in m], "versions": [0 if x else None for x in m],
                        "old_logprobs": [-3.0 if x else None for x in m],
                        "provenance": ["exact" if x else None for x in m]})
    return out


def _step(precision, checkpointing="off", lr=1e-2):
    learner = Learner(SPEC, init_weights(SPEC, 0, 0.1), lr=lr, objective=ObjectiveConfig(max_update_kl=None),
                      tile=None, minibatches=2)
    set_precision(learner, precision)
    set_checkpointing(learner, checkpointing)
    learner.rl_step(_batch())
    return learner


def test_bf16_computes_in_bf16_over_fp32_state():
    a, b = _step("fp32"), _step("bf16")
    w0 = init_weights(SPEC, 0, 0.1)
    for learner in (a, b):
        assert all(p.dtype == torch.float32 for p in learner.params.values())
        assert all(v.dtype == torch.float32 for st in learner.optimizer.state.values() for k, v in st.items()
                   if k != "step")
        assert all(v.dtype == torch.float32 for v in (*learner.reference.values(), *learner.ewma.params.values()))
    moved = {k: float((a.params[k] - w0[k]).norm()) for k in w0}
    diffs = [float((a.params[k] - b.params[k]).norm()) / moved[k] for k in w0 if moved[k] > 0]
    assert max(diffs) < 0.5  # the same update, at bf16's resolution
    assert max(diffs) > 1e-4  # negative control: bf16 is not silently fp32


def test_bf16_gradient_sum_on_the_wire():
    class Sum2:  # two equal ranks
        world = 2

        def all_reduce(self, t, op="sum"):
            self.dtype = t.dtype
            return t.mul_(2)

    g = torch.randn(10, 3) * 1.001
    p = {"w": torch.zeros(10, 3, requires_grad=True)}
    p["w"].grad = g.clone()
    r = Sum2()
    sum_gradients(r, p, {}, torch.bfloat16)
    assert r.dtype == torch.bfloat16 and p["w"].grad.dtype == torch.float32
    assert torch.equal(p["w"].grad, (g.to(torch.bfloat16) * 2).float())
    assert not torch.equal(p["w"].grad, g * 2)  # negative control: the wire rounded


def test_precision_is_checked():
    with pytest.raises(ValueError, match="unknown training precision"):
        set_precision(_step("fp32"), "fp8")
    assert TrainerConfig().precision == "fp32"
    with pytest.raises(ValueError):
        TrainerConfig(precision="fp16")


def test_activation_checkpointing_gives_the_same_update():
    """Recomputing the activations in the backward changes memory, not the update."""
    a = _step("fp32")
    for mode in ("layer", "half"):
        b = _step("fp32", mode)
        assert all(torch.equal(a.params[k], b.params[k]) for k in a.params), mode
    c = _step("fp32", "layer", lr=1.1e-2)  # negative control: the comparison sees a different update
    assert not all(torch.equal(a.params[k], c.params[k]) for k in a.params)
    with pytest.raises(ValueError, match="unknown activation checkpointing"):
        set_checkpointing(a, "every")
    assert TrainerConfig().activation_checkpointing == "off"

"""A loss of one's own: `objective.loss: "package.module:function"`.

The function replaces the policy-gradient term of the decoupled PPO loss (the KL term, the
trust-region guard and the built-in metrics stay). It is called on each rank for each
micro-batch of rows (and once per tree, its rows being the tree's branches) with `LossInputs`,
and returns the micro-batch's share of the loss, a scalar tensor whose gradient flows through
`lp_theta`, or that and a dict of metric sums:

    def my_loss(x: LossInputs) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...                                   # shapes (B, T); tokens outside `keep` are padding
        return -(x.scale * x.weight * x.advantages * term).sum(), {"my_count": n}
    my_loss.metrics = ("my_count",)           # the metric names, declared up front

Add the rows' terms weighted by `x.scale` (each token's coefficient: 1/N0 under `token_mean`,
the sequence-level coefficients otherwise, zero outside `keep`) and the shares of all ranks sum
to the minibatch's loss whatever the split of the batch over training cells. Metrics are sums
over the micro-batch's tokens: every rank's are added (the names declared in the function's
`metrics` attribute fix the layout of that reduction, so a rank with no rows adds zeros) and the
update reports each, summed over ranks and minibatches, as `loss_<name>`.

Where the name comes from: only from the local configuration of the process that imports it
(the trainer's `trainer.objective.loss`, and each cell's own copy of the same config, or
`--loss` of a bare training rank); a cell refuses a step whose coordinator names another loss,
since importing a name that arrived over the network is running code the network chose. The
module must be importable on every node: installed in each node's environment
(`pip install`), or on Ray shipped with the job's runtime environment (`py_modules` or
`working_dir`, which every actor of the job imports from).

`reinforce_with_weights` below is an example (a REINFORCE term with the decoupled weights, no
clip, and the count of tokens with a negative advantage), used by the tests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """Everything is (B, T) and detached except `lp_theta`; padding is outside `mask`."""

    lp_theta: Tensor
    """Log-probs under the current parameters: the only input with a gradient."""
    lp_prox: Tensor
    """Log-probs at the update's start (π_prox)."""
    lp_behav: Tensor
    """The sampler's log-probs (π_behav)."""
    lp_old: Tensor
    """π_old: the exact old-policy log-prob where scored, else the EWMA stand-in's (`missing`)."""
    missing: Tensor
    """Bool: no exact old log-prob for this token (the stand-in was used)."""
    advantages: Tensor
    """A per token."""
    mask: Tensor
    """Bool: sampled tokens (the loss mask)."""
    keep: Tensor
    """Bool, within `mask`: kept by the correction masks (the built-in loss's tokens)."""
    weight: Tensor
    """w_t: c_d(r_d) · min(r_stale, C_s), zero outside `keep`."""
    scale: Tensor
    """Each token's coefficient in the sum: 1/N0 or the sequence-level one; zero outside `keep`."""
    log_ratio: Tensor
    """log r_t (`ratio: token`) or log s of the token's sequence (`ratio: sequence`), zero
    outside `keep` (with the gradient through `lp_theta`)."""
    versions_behind: Tensor | None
    """Versions between the token's sampler and the update's start (0 = on-policy), −1 outside `mask`."""
    cfg: Any
    """The ObjectiveConfig (clip bounds and the rest)."""


class LossFn(Protocol):
    """`metrics` (optional attribute): the names of the metric sums the function returns."""

    def __call__(self, x: LossInputs) -> Tensor | tuple[Tensor, dict[str, Tensor | float]]: ...


@cache
def load_loss(name: str) -> LossFn:
    """The function `name` ("package.module:function") names, imported once."""
    module, _, attr = name.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"objective.loss {name!r}: {module} has no callable {attr}")
    names = getattr(fn, "metrics", ())
    if not isinstance(names, tuple) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(f"objective.loss {name!r}: `metrics` must be a tuple of identifiers")
    return fn


def loss_metric_names(name: str | None) -> tuple[str, ...]:
    """The update metrics a configured loss adds (`loss_<name>`), in a fixed order."""
    return () if name is None else tuple(f"loss_{n}" for n in getattr(load_loss(name), "metrics", ()))


def custom_pg_loss(name: str, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured loss on `x`: its scalar and its declared metrics (zeros where it gave none)."""
    fn = load_loss(name)
    out = fn(x)
    loss, extra = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError(f"objective.loss {name!r} must return a scalar tensor, got {type(loss).__name__}")
    unknown = set(extra) - set(getattr(fn, "metrics", ()))
    if unknown:
        raise ValueError(f"objective.loss {name!r} returned undeclared metrics {sorted(unknown)}")
    return loss, {f"loss_{k}": torch.as_tensor(extra.get(k, 0.0), dtype=torch.float64).detach()
                  for k in getattr(fn, "metrics", ())}


def reinforce_with_weights(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Example: −Σ scale · w · A · r_t with r_t = exp(log r_t) (its gradient is w·A·∇log π at
    r_t = 1): the decoupled objective without the clip; reports the tokens with A < 0."""
    r = torch.where(x.keep, x.log_ratio.exp(), 0.0)
    return -(x.scale * x.weight * x.advantages * r).sum(), {"negative_tokens": (x.keep & (x.advantages < 0)).sum()}


reinforce_with_weights.metrics = ("negative_tokens",)  # type: ignore[attr-defined]

"""PPO-EWMA: a parameter average that stands in for missing old log-probs.

After each optimizer step:  W' = beta·W + 1;  theta_ewma ← (beta·W/W')·theta_ewma + (1/W')·theta;
W ← W'  (W starts at 1, theta_ewma at theta). Unrolled, theta_ewma is the beta-weighted mean
of every parameter vector seen since the last reset. Its mean age is beta/(1−beta) steps, so
beta = W_stale/(W_stale+1) centres it on a staleness window of W_stale steps.

Auto-reset (theta_ewma ← theta, W ← 1) when the fraction of missing-provenance tokens whose
exp(lp_stand − lp_behav) lies in the band [C_lo, C_hi] falls below tau: the average then no
longer resembles the policies that sampled them. The rule reads the band, not the loss mask:
under token TIS nothing leaves the mask, so a mask-based rule would never fire. The loss
reports the count as `num_missing_in_band` (ppo.py).

The average is a dict of tensors (a state dict) kept where the caller says, by default host
memory, in float32 so that small steps are not lost to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def beta_for_window(staleness_window: float) -> float:
    """beta = W_stale / (W_stale + 1); W_stale = 0 gives beta = 0 (no averaging)."""
    if staleness_window < 0:
        raise ValueError(f"staleness_window must be >= 0, got {staleness_window}")
    return staleness_window / (staleness_window + 1.0)


class PPOEWMA:
    """EWMA of a parameter state dict. `update` and `reset` mutate the average in place."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        *,
        staleness_window: float,
        reset_threshold: float = 0.5,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 0.0 <= reset_threshold <= 1.0:
            raise ValueError(f"reset_threshold must lie in [0, 1], got {reset_threshold}")
        self.beta = beta_for_window(staleness_window)
        self.reset_threshold = reset_threshold
        self.device = torch.device(device)
        self.dtype = dtype
        self.params: dict[str, Tensor] = {name: self._copy(t) for name, t in params.items()}
        """theta_ewma by parameter name."""
        self.weight = 1.0
        """W: the total (unnormalised) weight of the average."""
        self.num_resets = 0
        """Resets since construction (auto or explicit)."""

    def reset(self, params: Mapping[str, Tensor]) -> None:
        """theta_ewma ← theta, W ← 1."""
        self.params = {name: self._copy(t) for name, t in params.items()}
        self.weight = 1.0
        self.num_resets += 1

    @torch.no_grad()
    def update(self, params: Mapping[str, Tensor], rows: Mapping[str, Tensor] | None = None) -> None:
        """Fold in the parameters after an optimizer step (same names and shapes). `rows`:
        for the tensors it names, only those rows are folded in (the caller knows the others
        equal the parameters already, e.g. vocabulary rows no step has moved)."""
        self._check_keys(params)
        new_weight = self.beta * self.weight + 1.0
        keep = self.beta * self.weight / new_weight
        add = 1.0 / new_weight
        for name, avg in self.params.items():
            theta = params[name].detach()
            if theta.shape != avg.shape:
                raise ValueError(
                    f"parameter {name}: shape {tuple(theta.shape)} != {tuple(avg.shape)}"
                )
            if not avg.is_floating_point():
                avg.copy_(theta)  # integer buffers (counters) are not averaged
                continue
            theta = theta.to(device=avg.device, dtype=avg.dtype)
            r = None if rows is None else rows.get(name)
            if r is None:
                avg.mul_(keep).add_(theta, alpha=add)
            elif r.numel():
                avg.index_copy_(0, r, avg.index_select(0, r).mul_(keep).add_(theta.index_select(0, r), alpha=add))
        self.weight = new_weight

    def should_reset(self, num_missing_in_band: int | float, num_missing: int | float) -> bool:
        """True when the fraction of missing-provenance tokens whose exp(lp_stand − lp_behav)
        lies in the band (the loss metric `num_missing_in_band`) is below tau.

        With no missing-provenance tokens the fraction is undefined and nothing resets.
        """
        if num_missing <= 0:
            return False
        return num_missing_in_band / num_missing < self.reset_threshold

    def maybe_reset(
        self,
        params: Mapping[str, Tensor],
        num_missing_in_band: int | float,
        num_missing: int | float,
    ) -> bool:
        """Reset to `params` if `should_reset`; returns whether it did."""
        if self.should_reset(num_missing_in_band, num_missing):
            self.reset(params)
            return True
        return False

    def state_dict(self) -> dict[str, Tensor]:
        """Averaged tensors (shared, not copied) plus the scalar W under `__ewma_weight__`."""
        out = dict(self.params)
        out["__ewma_weight__"] = torch.tensor(self.weight, dtype=torch.float64)
        return out

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore from `state_dict()` (e.g. read back from safetensors)."""
        state = dict(state)
        if "__ewma_weight__" not in state:
            raise ValueError("state has no __ewma_weight__ entry")
        self.weight = float(state.pop("__ewma_weight__"))
        self.params = {name: self._copy(t) for name, t in state.items()}

    def _copy(self, t: Tensor) -> Tensor:
        dtype = self.dtype if t.is_floating_point() else t.dtype
        return t.detach().to(device=self.device, dtype=dtype, copy=True)

    def _check_keys(self, params: Mapping[str, Tensor]) -> None:
        if params.keys() != self.params.keys():
            missing = sorted(set(self.params) - set(params))
            extra = sorted(set(params) - set(self.params))
            raise ValueError(
                f"parameter names differ from the average: missing {missing}, extra {extra}"
            )

"""Configuration of the RL objective (docs/RL.md: correction, decoupled PPO, KL, trees).

Pydantic models with a docstring under every field; unknown keys are rejected, and every
choice that selects a variant (correction mode, KL placement, advantage estimator) is a
discriminated union on `type`, so a bad value fails with the list of valid ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# --- train/inference correction c_d(r_d) -------------------------------------------------


class NoCorrection(_Strict):
    """c = 1: no train/inference correction (the catastrophic reject still applies)."""

    type: Literal["none"] = "none"
    """Correction selector."""


class TISTokenCorrection(_Strict):
    """Truncated importance sampling per token: c = min(rho, cap)."""

    type: Literal["tis_token"] = "tis_token"
    """Correction selector."""
    cap: float = Field(default=2.0, gt=0)
    """Truncation C of the per-token ratio."""


class TISSequenceCorrection(_Strict):
    """Truncated importance sampling per sequence: c = min(exp(sum M·log rho), cap)."""

    type: Literal["tis_sequence"] = "tis_sequence"
    """Correction selector."""
    cap: float = Field(default=2.0, gt=0)
    """Truncation C of the sequence ratio (the same c for every token of the sequence)."""


class _Bounds(_Strict):
    low: float = Field(default=0.5, gt=0)
    """Smallest kept ratio C_lo (inclusive)."""
    high: float = Field(default=2.0, gt=0)
    """Largest kept ratio C_hi (inclusive)."""

    @model_validator(mode="after")
    def _check_bounds(self):
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be smaller than high ({self.high})")
        return self


class MISTokenCorrection(_Bounds):
    """Masked importance sampling (IcePop) per token: c = rho·1[low ≤ rho ≤ high];
    tokens outside the bounds leave the loss mask."""

    type: Literal["mis_token"] = "mis_token"
    """Correction selector."""


class MISSequenceCorrection(_Bounds):
    """Masked importance sampling per sequence: keep the sequence iff its statistic s lies in
    [low, high]; kept tokens get c = s, the others leave the loss mask."""

    type: Literal["mis_sequence"] = "mis_sequence"
    """Correction selector."""
    statistic: Literal["product", "geometric_mean"] = "product"
    """s = exp(sum M·log rho) (`product`) or exp(mean_M log rho) (`geometric_mean`)."""


CorrectionConfig = Annotated[
    NoCorrection
    | TISTokenCorrection
    | TISSequenceCorrection
    | MISTokenCorrection
    | MISSequenceCorrection,
    Field(discriminator="type"),
]
"""One of the train/inference correction modes, chosen by `type`."""


# --- KL to the reference ------------------------------------------------------------------


class KLInReward(_Strict):
    """KL penalty folded into the reward: R ← R − coef·sum_t M·weight·k (k1 by default)."""

    type: Literal["reward"] = "reward"
    """Placement selector."""
    coef: float = Field(default=0.001, ge=0)
    """Penalty coefficient beta."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token estimator; k1 is the unbiased choice for a reward penalty."""


class KLInLoss(_Strict):
    """KL penalty added to the loss: coef·(1/N0)·sum_t M'·weight·k. Whatever value it
    reports, the loss follows weighted k2's gradient, whose expectation is
    grad KL(pi_theta || pi_ref) (k3's own gradient is the reverse KL's; see docs/RL.md)."""

    type: Literal["loss"] = "loss"
    """Placement selector."""
    coef: float = Field(default=0.001, ge=0)
    """Penalty coefficient beta."""
    estimator: Literal["k2", "k3"] = "k3"
    """Reported per-token value: k3 (unbiased, ≥ 0) or k2; the gradient is k2's either way.
    k1 is refused: as a loss its expected gradient is zero (it belongs in the reward)."""

    @field_validator("estimator", mode="before")
    @classmethod
    def _refuse_k1(cls, v):
        if v == "k1":
            raise ValueError(
                "k1 has zero expected gradient as a loss term: use k2 or k3 here, "
                "or put k1 in the reward (type: reward)"
            )
        return v


KLConfig = Annotated[KLInReward | KLInLoss, Field(discriminator="type")]
"""Where the KL penalty enters, chosen by `type`."""


# --- advantages ---------------------------------------------------------------------------


class GRPOAdvantage(_Strict):
    """A_i = (R_i − mean_G R) / (std_G R + eps), Bessel-corrected std; with the objective's
    `advantage_norm: none`, A_i = R_i − mean_G R."""

    type: Literal["grpo"] = "grpo"
    """Estimator selector."""
    eps: float = Field(default=1e-6, ge=0)
    """Added to the group std so that constant-reward groups get A = 0."""


class RLOOAdvantage(_Strict):
    """A_i = R_i − mean of the other rewards in the group."""

    type: Literal["rloo"] = "rloo"
    """Estimator selector."""


AdvantageConfig = Annotated[GRPOAdvantage | RLOOAdvantage, Field(discriminator="type")]
"""Group-relative advantage estimator, chosen by `type`."""


# --- PPO-EWMA and trees -------------------------------------------------------------------


DEFAULT_EWMA_BAND = (0.5, 2.0)
"""Band of the PPO-EWMA reset rule when neither it nor an MIS correction sets one."""


def ewma_window(ewma: EWMAConfig, staleness_bound: int, minibatches: int) -> float:
    """W_stale: the configured one, else the staleness bound's span in optimizer steps."""
    return ewma.staleness_window if ewma.staleness_window is not None else float(staleness_bound * minibatches)


class EWMAConfig(_Strict):
    """PPO-EWMA parameter average that stands in for missing old log-probs."""

    staleness_window: float | None = Field(default=None, ge=0)
    """W_stale in optimizer steps; beta = W_stale / (W_stale + 1) centres the average there.
    None: the staleness bound's span, `staleness_bound` versions × the optimizer steps of one
    version (`minibatches`): the average then stands in for a policy as old as the oldest
    token the bound lets train (the trainer resolves it from the scheduler's bound)."""
    reset_threshold: float = Field(default=0.5, ge=0, le=1)
    """tau: reset the average to the current parameters when the fraction of
    missing-provenance tokens whose exp(lp_stand − lp_behav) lies in the band falls below
    this. Judged on the band whatever the correction mode: under token TIS no token ever
    leaves the loss mask, so a rule on the mask would never fire."""
    band: tuple[float, float] | None = None
    """[C_lo, C_hi] of the reset rule; None: the correction's bounds when it is MIS (token or
    sequence), else (0.5, 2.0)."""

    @model_validator(mode="after")
    def _check_band(self):
        if self.band is not None and not 0 < self.band[0] < self.band[1]:
            raise ValueError(f"band must satisfy 0 < low < high, got {self.band}")
        return self


class TreeConfig(_Strict):
    """Tree rollouts (sub-agents, parallel tool calls, compaction)."""

    max_branches: int = Field(default=5, ge=1, le=5)
    """Root-to-leaf branches kept per tree (at most 5)."""
    selection: Literal["creation_order", "seeded"] = "creation_order"
    """How branches are chosen, never by reward: the first leaves created, or a seeded draw."""
    seed: int = 0
    """Seed of the `seeded` draw (combined with the tree's own id by the caller)."""


# --- the objective ------------------------------------------------------------------------


class ObjectiveConfig(_Strict):
    """The decoupled PPO objective with train/inference correction."""

    correction: CorrectionConfig = TISTokenCorrection()
    """Train/inference correction c_d(r_d)."""
    reject_below: float | None = Field(default=1e-4, gt=0)
    """Catastrophic reject: drop a sequence with any rho below this (None: never)."""
    self_normalize: bool = False
    """Divide c by its mean over the kept tokens of the batch."""
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    """eps: r_t is clipped below at 1 − eps."""
    clip_high: float = Field(default=0.2, gt=0)
    """eps_hi: r_t is clipped above at 1 + eps_hi (asymmetric clip-higher when > eps)."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual clip c > 1: for A < 0 the per-token loss is capped at c·|A| (None: off)."""
    staleness_cap: float = Field(default=2.0, gt=0)
    """C_s in min(r_stale, C_s)."""
    kl: KLConfig | None = None
    """KL penalty to the reference policy (None: off)."""
    max_update_kl: float | None = Field(default=0.1, gt=0)
    """Trust-region guard: an RL update whose k3 estimate of KL(π_prox ‖ π_new) over its batch's
    kept tokens (`update_kl_terms`) exceeds this is rejected whole and counted, and publishes
    nothing (cells/rl/guard.py). None: off (no snapshot of the optimizer state is kept).
    The default is derived from `bench/lr_sweep.py` in docs/RL.md (about 7× the largest update
    at the shipped learning rate, below the updates of every run that ended worse)."""
    update_kl_is_cap: float = Field(default=2.0, gt=1)
    """The truncation of the importance weight π_prox/π_behav that reweights the sampled tokens
    in that KL estimate (and the `approx_kl` metric)."""
    advantage: AdvantageConfig = GRPOAdvantage()
    """Group-relative advantage estimator."""
    advantage_norm: Literal["group_std", "none"] = "group_std"
    """GRPO's centred reward divided by the group's std (`group_std`) or not (`none`: Dr.
    GRPO, whose argument is that a near-uniform group's small std blows its advantages up and
    weighs easy and hopeless prompts most). RLOO is never divided."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How per-token terms add up to the loss (S: sequences of the minibatch over all ranks, a
    sequence being a trajectory or a tree's branch; N0: their tokens): `token_mean` Σ_t / N0
    (every token weighs the same); `seq_mean_token_mean` (1/S) Σ_seq (1/|seq|) Σ_t (every
    sequence weighs the same); `seq_mean_token_sum_norm` (1/S) Σ_seq Σ_t / `loss_agg_constant`
    (Dr. GRPO: no length normalisation per sequence)."""
    loss_agg_constant: float = Field(default=1024.0, gt=0)
    """The constant of `seq_mean_token_sum_norm` (Dr. GRPO's, e.g. the generation budget)."""
    ratio: Literal["token", "sequence"] = "token"
    """The PPO ratio: per token (r_t), or per sequence (GSPO: s = exp of the mean of
    lp_theta − lp_prox over the sequence's kept tokens, clipped by `clip_low`/`clip_high`, which
    GSPO sets near 3e-4 and 4e-4; every token of the sequence carries s; a tree's sequences are
    its branches)."""
    loss: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """A loss of one's own, "package.module:function" (cells/rl/objectives/custom.py has the
    signature and an example). Imported only from the local configuration of the trainer and
    of each cell, never from a name sent over the wire: a cell refuses a step whose
    coordinator names another."""
    ewma: EWMAConfig = EWMAConfig()
    """PPO-EWMA stand-in for missing old log-probs."""
    tree: TreeConfig = TreeConfig()
    """Tree rollouts."""

    def ewma_band(self) -> tuple[float, float]:
        """[C_lo, C_hi] of the PPO-EWMA reset rule (see `EWMAConfig.band`)."""
        if self.ewma.band is not None:
            return self.ewma.band
        if isinstance(self.correction, MISTokenCorrection | MISSequenceCorrection):
            return (self.correction.low, self.correction.high)
        return DEFAULT_EWMA_BAND

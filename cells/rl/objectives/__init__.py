"""The RL objective: ratios, train/inference correction, decoupled PPO, PPO-EWMA, advantages,
KL to the reference and tree rollouts. One concept per module; the formulas and their checks are in docs/RL.md.

    ratios       r_d · r_stale · r_t decomposition of pi_theta/pi_behav
    correction   c_d(r_d): TIS / MIS (IcePop) per token or sequence, reject, normalise
    ppo          the decoupled PPO loss, w_t for exact and missing lp_old, metrics
    ewma         PPO-EWMA parameter average standing in for missing lp_old
    advantages   GRPO and RLOO
    kl           k1 / k2 / k3 estimators, in the reward or in the loss
    tree         rollout trees: branch selection, serialisation, the tree loss
    config       pydantic models of all of the above
"""

from cells.rl.objectives.advantages import (
    compute_advantages,
    expand_to_tokens,
    grpo_advantages,
    member_advantages,
    rloo_advantages,
)
from cells.rl.objectives.config import (
    EWMAConfig,
    GRPOAdvantage,
    KLInLoss,
    KLInReward,
    MISSequenceCorrection,
    MISTokenCorrection,
    NoCorrection,
    ObjectiveConfig,
    RLOOAdvantage,
    TISSequenceCorrection,
    TISTokenCorrection,
    TreeConfig,
)
from cells.rl.objectives.correction import Correction, apply_correction
from cells.rl.objectives.ewma import PPOEWMA, beta_for_window
from cells.rl.objectives.kl import (
    add_kl_to_rewards,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    update_kl_terms,
)
from cells.rl.objectives.ppo import (
    PROVENANCE_EXACT,
    PROVENANCE_MISSING,
    TokenWeights,
    decoupled_ppo_loss,
    ppo_objective,
    token_weights,
)
from cells.rl.objectives.ratios import LogRatios, log_ratios
from cells.rl.objectives.tree import (
    MAX_BRANCHES,
    RolloutTree,
    SerializedTree,
    select_branches,
    select_branches_for,
    serialize_tree,
    tree_ppo_loss,
)

__all__ = [
    "MAX_BRANCHES",
    "PPOEWMA",
    "PROVENANCE_EXACT",
    "PROVENANCE_MISSING",
    "Correction",
    "EWMAConfig",
    "GRPOAdvantage",
    "KLInLoss",
    "KLInReward",
    "LogRatios",
    "MISSequenceCorrection",
    "MISTokenCorrection",
    "NoCorrection",
    "ObjectiveConfig",
    "RLOOAdvantage",
    "RolloutTree",
    "SerializedTree",
    "TISSequenceCorrection",
    "TISTokenCorrection",
    "TokenWeights",
    "TreeConfig",
    "add_kl_to_rewards",
    "apply_correction",
    "beta_for_window",
    "compute_advantages",
    "decoupled_ppo_loss",
    "expand_to_tokens",
    "grpo_advantages",
    "member_advantages",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "update_kl_terms",
    "log_ratios",
    "ppo_objective",
    "rloo_advantages",
    "select_branches",
    "select_branches_for",
    "serialize_tree",
    "token_weights",
    "tree_ppo_loss",
]

"""The `trainer:` section: the built-in trainer and the toy agentic task `cellflip up` runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from scheduler.contract.config.base import Strict as _Strict
from scheduler.contract.exports import EXPORT_PATH_PATTERN


class TrainerConfig(_Strict):
    """The built-in trainer and the toy agentic task that `cellflip up` runs."""

    enabled: bool = False
    """Run the trainer and the agents (off: `cellflip up` serves the API only)."""
    steps: int = Field(default=20, ge=0)
    """RL steps; each flips cells to training, trains on a batch, publishes a version."""
    batch_episodes: int = Field(default=16, gt=0)
    """Finished rollouts (group members) per RL step; a tree rollout's branch sessions count
    once, as the one member they are."""
    group_size: int = Field(default=4, gt=1)
    """Episodes per task instance (a GRPO/RLOO group); a group is trained only whole."""
    group_deadline_s: float = Field(default=600.0, gt=0)
    """A group not complete this long after its first member reached the trainer is dropped
    whole and counted (`cellflip_groups_dropped_total{reason="deadline"}`)."""
    drop_uniform_groups: bool = False
    """Dynamic sampling: drop (and count) complete groups whose rewards are all equal; their
    advantages are zero, so they only dilute the token mean."""
    train_cells: int = Field(default=1, ge=0)
    """Cells flipped to training for each step (they hand their rollouts over live)."""
    train_cell_choice: Literal["planner", "busiest"] = "planner"
    """Which cells train: the planner's pick (the cheapest to drain), or the rollout cells
    with the most requests in flight (every flip then moves live rollouts: the demo's
    choice, to show live migration under load)."""
    lr: float = Field(default=1e-3, ge=0)
    """RL learning rate (0: a control run whose weights never move after the warm-up). 1e-3:
    the best held-out score of `bench/lr_sweep.py` with updates under 0.35 nats/token; at 2e-3
    single updates moved the policy 1.6–5.3 nats/token (docs/RL.md)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After the learning-rate warm-up: constant, or a cosine or linear decay over the run's RL
    optimizer steps (`steps` x `minibatches`) down to `lr_min_ratio` of `lr`."""
    lr_min_ratio: float = Field(default=0.1, ge=0, le=1)  # where a decaying schedule ends, a fraction of `lr`
    reject_lr_backoff: float = Field(default=0.5, gt=0, le=1)
    """After an update the trust-region guard rejected, the learning rate is multiplied by this
    (the update published nothing; the next one tries a smaller step)."""
    reject_lr_recovery: float = Field(default=2.0, ge=1)
    """After each kept update the learning rate is multiplied by this, up to `lr`."""
    minibatches: int = Field(default=2, ge=1)
    """Optimizer steps per RL update (one published version): lp_prox is taken once at the
    start of the update, so from the second minibatch on the PPO clip binds."""
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 compute and gradient sums, fp32 state (cells/rl/precision.py)
    activation_checkpointing: Literal["off", "layer", "half"] = "off"  # recomputed per layer / half layer in the backward
    shard_layout: Literal["flat", "gathered"] = "flat"
    """With `cells.train_ranks` S > 1: `flat` keeps a whole fp32 compute copy on every rank
    (4 + 32/S B/param at rest); `gathered` keeps only the slices and gathers each layer for
    its forward (36/S B/param, the layout a 32B model on 8-GPU cells needs; docs/TRAINING.md)."""
    lr_warmup_steps: int = Field(default=4, ge=0)
    """Optimizer steps over which the RL learning rate ramps up linearly (the optimizer's
    moments are reset when RL starts)."""
    train_timeout_s: float = Field(default=30.0, gt=0)
    """Per-operation timeout of a training step: a dead or stalled cell fails the attempt after it."""
    resume_wait_s: float = Field(default=10.0, ge=0)  # a restarted trainer's wait for cells to reconnect
    warmup_lr: float = Field(default=3e-3, ge=0)
    """Learning rate of the supervised warm-up (its optimizer moments are dropped when RL starts)."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Supervised warm-up steps on the toy task's demonstrations before RL. None: 300 from
    random weights, none from the user's (`cells.engine.model.path`)."""
    init_std: float = Field(default=0.1, gt=0)
    """Initial weight scale of the trainer's model (toy models need more than 0.02 to learn to copy in a CPU warm-up)."""
    warmup_batch: int = Field(default=16, gt=0)
    seed: int = 0
    """Seeds the task stream, the warm-up and the sampling seeds of the agents."""
    task: dict[str, Any] = Field(default_factory=dict)
    """The toy task's variant: TaskSpec fields other than the seed (`first_item`, `num_items`,
    `p_pair`, `p_redirect`, `max_depth`); empty: the default task."""
    first_version: int = Field(default=1, ge=1, lt=1 << 61)
    """The version number of the trainer's first commit (the warm-up's); its updates count up
    from it. RL jobs sharing a fleet take disjoint ranges (version ids are fleet-wide)."""
    agents: int = Field(default=8, gt=0)
    """Episodes in flight at once."""
    max_turns: int = Field(default=6, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    max_tokens_per_turn: int = Field(default=64, gt=0)
    branch_fraction: float = Field(default=0.25, ge=0, le=1)
    """Share of episodes that fork into sub-agent branches (tree rollouts)."""
    long_fraction: float = Field(default=0.0, ge=0, le=1)
    """Share of episodes followed by a long continuation (a few hundred to a few thousand
    sampled tokens, long-tailed) on a session of its own, never trained on: the toy task's
    turns are short, and these are the long rollouts a flip must move live."""
    long_max_tokens: int = Field(default=2048, gt=0)
    checkpoint_dir: str | None = "runs/trainer"
    """Checkpoints (parameters, optimizer, RNG, data cursor, version); None: none."""
    checkpoint_every: int = Field(default=5, gt=0)
    export_every: int = Field(default=0, ge=0)  # every N-th version written by a cell to `export_dir`/vN; 0: never
    export_dir: str = Field(default="trainer", pattern=EXPORT_PATH_PATTERN)  # relative, below cells.export_root
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """float32 serves bitwise like the embedded cells; bfloat16 halves the files."""
    host: str = "127.0.0.1"
    """Address cells reach the trainer's version host at."""
    objective: dict[str, Any] = Field(default_factory=dict)
    """The RL objective (cells/rl/objectives/config.py: advantages, correction, PPO
    clip, EWMA, KL); validated by the trainer at start-up."""

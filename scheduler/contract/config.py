"""Configuration: YAML files loaded into pydantic models.

Every field carries a docstring; unknown keys are rejected, and a bad file fails with a
`ConfigError` that names the offending key path and value. This module imports neither
torch nor `cells`, so the control plane, the cells and the cluster simulator share it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from scheduler.contract.cells_config import CellsConfig
from scheduler.contract.config_base import ConfigError
from scheduler.contract.config_base import Strict as _Strict
from scheduler.contract.engine_config import (
    EmbeddedEngineConfig,
    EngineConfig,
    ModelConfig,
    SGLangEngineConfig,
)
from scheduler.contract.exports import EXPORT_PATH_PATTERN
from scheduler.contract.trajexport import StoreConfig

SCHEDULER_CONFIG_ENV = "CELLFLIP_SCHEDULER_CONFIG"
"""A scheduler started by module path reads its whole config (JSON text) from this variable."""
SHARED_PROCESS_ENV = "CELLFLIP_SCHEDULER_SHARES_PROCESS"
"""Set to 1 by a launcher that runs the scheduler in a thread of a process doing other work:
the scheduler then leaves the process's garbage collection alone (`create_app(manage_gc=...)`)."""

__all__ = ["SCHEDULER_CONFIG_ENV", "CellsConfig", "ConfigError", "EmbeddedEngineConfig", "EngineConfig", "ModelConfig", "SGLangEngineConfig"]


class MigrationConfig(_Strict):
    """Live KV migration."""

    max_copy_rounds: int = Field(default=4, ge=0)
    """Copy rounds while decoding before the stop-and-copy."""
    stop_copy_blocks: int = Field(default=2, ge=0)
    """Stop and copy once fewer than this many blocks remain to send."""
    on_round_limit: Literal["stop_and_copy", "abort"] = "stop_and_copy"
    """What to do when the round limit is hit with more than stop_copy_blocks left."""
    transfer_timeout_s: float = Field(default=20.0, gt=0)
    """Bound on any one transfer; a fresh group is made after an error."""
    headroom_blocks: int = Field(default=8, ge=0)
    """Blocks the destination reserves beyond the current length."""
    copy_quiesce: Literal["auto", "on", "off"] = "auto"
    """Pause decoding on both ends while a copy round's KV is on the wire. On CPU cells the
    transfer and the decode share the cores: a copy round competing with a decode loop runs
    several times slower than the link (every socket-buffer refill waits for a time slice),
    which holds the migration, and a flip, open that much longer. `auto`: on where the KV pool
    is in host memory."""
    copy_quiesce_max_ms: float = Field(default=100.0, gt=0)
    """Bound on one quiesce: decoding goes on after this even if the copy has not finished."""
    path: Literal["auto", "reprefill"] = "auto"
    """`auto`: move the KV where both cells export it and serve the same version, else
    re-prefill; `reprefill`: always abort and re-prefill elsewhere (what systems without live
    KV migration do; kept for comparison)."""
    park_on_deadline: bool = True
    """At a drain deadline, requests that found no destination keep their KV in the draining
    cell's host memory (parked) and move on by KV migration once a cell has room; off (or a
    cell that cannot export KV): they are dropped there and re-prefilled later."""


class VersionsConfig(_Strict):
    """Weight versions and the log-prob service."""

    bucket_bytes: int = Field(default=8 << 20, gt=0)
    """Bytes per broadcast bucket."""
    update_backend: Literal["gloo", "nccl"] = "gloo"
    """Collective of the update groups that carry versions to cells receiving them through
    their engine's own group (SGLang cells): `nccl` on GPU clusters, `gloo` on CPU."""
    inflight_policy: Literal["keep_kv", "recompute"] = "keep_kv"
    """In-flight requests across an update: continue on stale KV, or re-prefill."""
    score_batch_tokens: int = Field(default=256, gt=0)
    """A request still generating under a version is scored once this many of its tokens wait
    (ended requests and switched versions are scored at once)."""
    score_interval_s: float = Field(default=0.2, gt=0)
    """How often the scheduler hands out scoring tasks."""
    max_tasks_per_cell: int = Field(default=4, gt=0)
    """Scoring tasks outstanding per cell (scoring runs at low priority beside decoding)."""
    task_timeout_s: float = Field(default=60.0, gt=0)
    """A scoring task (or scoring-only fetch) unanswered for this long is handed out again."""
    max_ranges_per_pass: int = Field(default=256, gt=0)
    """Unscored (request, version) ranges considered per pass."""
    auto_retire: bool = True
    """Retire a superseded version as soon as no cell serves it and every token is scored."""
    load_timeout_s: float = Field(default=60.0, gt=0)
    """A cell that has not reported a version it was told to load is told again after this."""
    load_deadline_s: float = Field(default=300.0, gt=0)
    """A flip to rollout whose cell has not loaded the current version within this is rolled
    back (the cell stays in training, the flip says why): no cell sits in `loading` for good."""
    max_version_step: int = Field(default=1000, gt=0)
    """A published version may be at most this far above the newest one the lineage holds
    (a number near the integer limit would otherwise block every later publish)."""


class AgentLimits(_Strict):
    """What one agent token may use, so that one sandbox cannot starve the others (each agent
    token has its own budget; trainer, cell and admin tokens have none)."""

    max_concurrent_sessions: int = Field(default=256, gt=0)
    """Sessions with a turn in flight at once (a chat turn or a `/v1/generate`; a session runs one
    turn at a time, so this bounds the token's share of the rollout slots)."""
    requests_per_s: float = Field(default=200.0, gt=0)
    """Sustained request rate (a token bucket refilled at this rate)."""
    burst: int = Field(default=400, gt=0)
    """Requests allowed at once above the sustained rate (the bucket's size)."""


class SchedulerConfig(_Strict):
    """The control plane process."""

    host: str = "127.0.0.1"
    """Bind address (loopback unless told otherwise)."""
    port: int = Field(default=8700, ge=0, lt=65536)
    """REST port (0 = pick a free port)."""
    db_path: str = "runs/cellflip.sqlite"
    """SQLite file of the durable store."""
    lease_s: float = Field(default=5.0, gt=0)
    """A cell whose heartbeat is older than this (scheduler monotonic clock) is fenced."""
    heartbeat_s: float = Field(default=0.5, gt=0)
    """Cell heartbeat interval."""
    auth: Literal["token", "none"] = "token"
    """`token`: every route but /healthz needs `Authorization: Bearer <token>` (scheduler/contract/tokens.py
    says where the token comes from). `none`: no auth, refused on a non-loopback `host`."""
    auth_token_file: str | None = None
    """File holding the admin token (every route; the only one that creates or revokes tokens).
    Unset: `CELLFLIP_API_TOKEN`, else `api.token` beside the store, generated on first start
    (mode 0600). Unreadable or empty: start-up fails. Every scope: scheduler/contract/tokens.py."""
    metrics_token_file: str | None = None
    """The scrape token (`GET /metrics` only, for Prometheus); unset: `CELLFLIP_SCRAPE_TOKEN`,
    else `metrics.token` beside the store, generated on first start. The admin token is accepted
    there too."""
    trainer_token_file: str | None = None
    """The trainer's bootstrap token (flips, versions, trajectories, reports, finishing
    sessions); unset: `CELLFLIP_TRAINER_TOKEN`, else `trainer.token` beside the store."""
    cell_token_file: str | None = None
    """The cells' bootstrap token (the cell protocol only); unset: `CELLFLIP_CELL_TOKEN`, else
    `cell.token` beside the store."""
    agent_token_file: str | None = None
    """The agents' bootstrap token (the gateway, `/v1/generate`, their own sessions); unset:
    `CELLFLIP_AGENT_TOKEN`, else `agent.token` beside the store."""
    agent_limits: AgentLimits = AgentLimits()
    """Abuse limits applied to each agent token on its own (429 past them)."""
    max_body_bytes: int = Field(default=8 << 20, gt=0)
    """Largest accepted request body (413 beyond)."""
    min_rollout_cells: int = Field(default=1, ge=0)
    """Rollout capacity that is never flipped away."""
    drain_deadline_s: float = Field(default=30.0, gt=0)
    """After this, requests still on a draining cell are suspended."""
    idempotency_ttl_s: float = Field(default=86400.0, gt=0)
    """An Idempotency-Key is remembered this long (wall clock); a replay after that is a new request."""
    stall_timeout_s: float = Field(default=120.0, gt=0)
    """A running request that its owner keeps reporting but that commits no token for this
    long is taken back (epoch + 1) and re-placed on another cell, token-exact from the store:
    the safety net for a cell that holds a request it does not decode. Counted in
    `cellflip_requests_stalled_total`; above any prefill time (chunked) on the fleet."""
    staleness_bound: int = Field(default=8, ge=0)
    """Most versions (published RL updates) a trajectory may lag the version it is trained at
    (AReaL's bound on off-policyness). Admission: a new session gets 429 while the sessions in
    flight plus the finished ones the trainer has not fetched reach (bound + 1) × the
    trainer's batch size. Hand-out: a trajectory whose oldest sampled token is more versions
    old than this follows `staleness_policy`. The planner reads the same bound."""
    staleness_policy: Literal["correct", "drop"] = "drop"
    """`drop` (the bound holds): a trajectory past the staleness bound at hand-out is handed out
    only as a record saying it was dropped (the trainer drops its whole group), and at training
    every rank leaves out of the loss each sampled token more than `staleness_bound` versions
    older than the update's start (a partly stale multi-turn session trains its fresh tokens;
    cells/rl/plan.py `mask_stale`). `correct` (an explicit choice): stale trajectories are
    trained with their correction weights (decoupled PPO: r_stale capped by the objective's
    C_s). Counted either way in `cellflip_stale_trajectories_total{policy}`, `GET /v1/versions`
    and the update's `stale_tokens_dropped`."""
    verify_tolerance: float = Field(default=1e-3, ge=0)
    """Where either cell is not batch-invariant, two log-probs of the same token and version
    agree within this many nats (registration probes, the log-prob service's cross-check);
    batch-invariant cells must agree bit for bit."""
    trust_unprobed_cells: bool = False
    """Count cells that cannot score (no probe, e.g. SGLang scoring on the trainer's copy) toward `min_rollout_cells` (off: only verified cells)."""
    auto_flip: bool = True
    """Run the planner's flip policy once the trainer declared its demand; POST /v1/flips overrides it."""
    store: StoreConfig = StoreConfig()
    """The store's housekeeping: bounded retention of trained trajectories (docs/EXPORT.md)."""


from scheduler.contract.tito.config import GatewayConfig  # noqa: E402  (no tokenizer is loaded here)


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


class LocalLauncherConfig(_Strict):
    """`cellflip up` starts every process on this machine as its own child (the embedded default)."""

    type: Literal["local"] = "local"
    """Launcher selector."""


class RayLauncherConfig(_Strict):
    """`cellflip up --ray`: the scheduler, the trainer and the cells start as actors on an
    existing Ray cluster (docs/RAY.md). Needs the `ray` extra."""

    type: Literal["ray"] = "ray"
    """Launcher selector."""
    address: str = "auto"
    """Ray cluster to join: `auto` (the one this machine belongs to) or a head's `host:port`."""
    namespace: str = Field(default="cellflip", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Ray namespace of the deployment's named actors (`cellflip-scheduler`, `cellflip-cell-N`,
    `cellflip-trainer`); two deployments on one Ray cluster need two namespaces."""
    scheduler_node: str | None = None
    """Node that holds the scheduler's store (a Ray node id or a node IP): `scheduler.db_path`
    is a path on it, and the scheduler actor is pinned there so that a restarted one reopens
    the same store. None: the node `cellflip up` runs on."""
    placement: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    """Strategy of the cells' placement group (one bundle per cell)."""
    cpus_per_cell: float = Field(default=1.0, gt=0)
    """CPUs in each cell's bundle."""
    gpus_per_cell: int | None = Field(default=None, ge=0)
    """GPUs in each cell's bundle; None: the SGLang engine's `tp` (0 for the embedded engine)."""
    max_restarts: int = Field(default=3, ge=0)
    """Restarts Ray grants each actor. A restarted cell is a new incarnation: the scheduler's
    fencing decides what it may still own."""
    ready_timeout_s: float = Field(default=300.0, gt=0)
    """Bound on the placement group, the scheduler and every cell coming up."""
    py_modules: list[str] = Field(default_factory=list, max_length=64)
    """Local directories (Python packages) or `.whl` files shipped to every actor with its
    runtime environment (Ray's `py_modules`): how code of one's own, such as the module of
    `trainer.objective.loss`, reaches cells on other nodes without installing it there."""


LauncherConfig = Annotated[LocalLauncherConfig | RayLauncherConfig, Field(discriminator="type")]


class CellflipConfig(_Strict):
    """Top-level configuration file."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """The control plane."""
    cells: CellsConfig = CellsConfig()
    """The cells."""
    migration: MigrationConfig = MigrationConfig()
    """Live KV migration."""
    versions: VersionsConfig = VersionsConfig()
    """Weight versions and old log-prob scoring."""
    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible chat gateway (`POST /v1/chat/completions`)."""
    trainer: TrainerConfig = TrainerConfig()
    """The built-in trainer and toy task (`cellflip up`)."""
    launcher: LauncherConfig = LocalLauncherConfig()
    """Where `cellflip up` starts its processes: this machine (`local`) or a Ray cluster (`ray`)."""

    @model_validator(mode="after")
    def _check(self) -> CellflipConfig:
        eng = self.cells.engine
        if isinstance(eng, EmbeddedEngineConfig) and eng.num_blocks is not None and eng.max_running > eng.num_blocks:
            raise ValueError("cells.engine.max_running exceeds cells.engine.num_blocks")
        if isinstance(eng, SGLangEngineConfig) and eng.scoring == "cell_copy" and self.versions.update_backend == "nccl":
            # The scoring copy's rank would receive on the cell's first GPU, which SGLang's tp
            # rank 0 already holds in the same communicator: NCCL refuses two ranks on one device.
            raise ValueError("cells.engine.scoring 'cell_copy' cannot be combined with versions.update_backend "
                             "'nccl' on SGLang cells (the scoring rank and SGLang's tp rank 0 would share one GPU "
                             "in one NCCL communicator); use scoring 'publisher_copy', or update_backend 'gloo'")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        val = e.get("input")
        shown = repr(val) if not isinstance(val, dict) else "{...}"
        lines.append(f"  {loc} = {shown[:80]}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict | None, source: str = "<dict>") -> CellflipConfig:
    """Validate a mapping into a `CellflipConfig`; raise `ConfigError` naming bad keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return CellflipConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path) -> CellflipConfig:
    """Read a YAML file into a `CellflipConfig`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {p}: {e}") from None
    return parse_config(data, str(p))

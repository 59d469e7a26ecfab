"""The control plane's settings: the scheduler process (`SchedulerConfig`, with its agents'
limits), live KV migration (`MigrationConfig`) and weight versions (`VersionsConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scheduler.contract.config.base import Strict as _Strict
from scheduler.contract.config.store import StoreConfig


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

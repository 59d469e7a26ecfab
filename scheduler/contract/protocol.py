"""Cell ⇄ scheduler protocol: one dataclass per message, JSON on the wire, never pickle.

One line: register → sync every heartbeat (summary + committed tokens + events ⇄ commands)
→ migrations end in a commit (compare-and-set of the owner) or an abort.

Routes (JSON bodies; `Authorization: Bearer <token>` when the scheduler has one):
  POST /internal/v1/cells/register          RegisterRequest → RegisterResponse
      409 {reason: "fenced"} when this (cell_id, incarnation) was fenced: restart as a new one.
      A new incarnation of a known cell id fences the old one; its requests re-prefill elsewhere.
  POST /internal/v1/cells/{cell_id}/sync    SyncRequest → SyncResponse
      404 unknown cell (register first); 409 {reason: "fenced" | "stale_incarnation"} when the
      incarnation is not the current one or its lease expired: drop every request, register
      again under a new incarnation. Leases run on the scheduler's monotonic clock only.
  POST /internal/v1/migrations/{id}/commit  CommitRequest → CommitResponse
      409 {reason}: "aborted", "stale_epoch", "not_destination", "fenced", "mismatch",
      "length_mismatch", "finished" (never resume), or "gap" (retryable: the migration stays
      pending; the source's earlier tokens have not arrived yet).
  POST /internal/v1/migrations/{id}/abort   AbortMigrationRequest → {"state": "aborted"}
      409 {reason: "committed"} when the commit already won: the caller must not resume.

Token rules (sync `tokens`): a batch is accepted only from the request's current owner at the
current epoch and only when `start` equals the number of generated tokens stored; an exact
duplicate of stored tokens is idempotent (its new suffix, if any, is appended). Accepted tokens
are committed before the sync returns, and only then released to the client's stream. A batch
refused for any reason puts its request id in `rejected`: the cell drops that request at once
(if it was the owner, ownership was revoked and the request re-prefills from the store).

Token record (scheduler/contract/records.py): `[token_id, logprob, version, truncated]`
(behavior log-prob and version under which it was sampled; `truncated`: the log-prob is of the
top-k/top-p truncated distribution); a batch's records are columns in memory, on the wire rows or
packed (base64 of little-endian arrays, what cells send; records.py, docs/LIFECYCLES.md).
Generated index `i` of a request is its i-th sampled token; `start` counts in that index.

Long-poll: with nothing to send, the scheduler holds the sync up to `wait_s` (≤ 1 s) or until a
command is queued for the cell. Commands are delivered once, in order; the scheduler's
reconciler re-derives lost ones (a request its owner does not report within a lease is
re-placed at epoch + 1; a cell reporting a request it does not own gets `abort`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from scheduler.contract.protocol_base import MAX_WAIT_S, Message, ProtocolError
from scheduler.contract.protocol_commands import (
    COMMANDS,
    EVENTS,
    AbortCmd,
    AnyCommand,
    AnyEvent,
    BroadcastEvent,
    CancelMigrationCmd,
    Command,
    Count,
    DropVersionCmd,
    ExportCmd,
    ExportedEvent,
    LoadVersionCmd,
    MigrateInCmd,
    MigrateOutCmd,
    MigrationEvent,
    PrefixMissingEvent,
    RoleFailedEvent,
    ScoreCmd,
    ScoredEvent,
    SetRoleCmd,
    StartCmd,
    SuspendCmd,
)
from scheduler.contract.records import TokenRecord, TokenRecords

__all__ = [
    "COMMANDS", "EVENTS", "MAX_WAIT_S", "AbortCmd", "AbortMigrationRequest", "AnyCommand", "AnyEvent", "BroadcastEvent", "CancelMigrationCmd",
    "Capabilities", "Command", "CommitRequest", "CommitResponse", "DropVersionCmd", "ExportCmd", "ExportedEvent",
    "LoadVersionCmd", "Message",
    "MigrateInCmd", "MigrateOutCmd", "ScoreCmd",
    "MigrationEvent", "PrefixMissingEvent", "ProtocolError", "RegisterRequest", "RegisterResponse", "RoleFailedEvent", "ScoredEvent",
    "SetRoleCmd", "StartCmd", "Summary", "SuspendCmd", "SyncRequest", "SyncResponse", "Tail", "TokenBatch",
    "TokenRecord", "TokenRecords", "decode_command", "decode_event", "dispatch",
]


# ---------------------------------------------------------------- register


@dataclass(frozen=True)
class Capabilities(Message):
    """What a cell's engine supports, fixed for its life: the engine reports it
    (`Engine.capabilities`, cells/engine/base.py), the cell registers with it, and the agent,
    version loading, the planner and the flip logic branch on it, never on types or attributes."""

    kv_export: bool = False
    """`KVHandover`: per-request KV export/import (live migration, path `kv`) and parking a
    request's KV in host memory; otherwise a moved request re-prefills."""
    scoring: bool = False
    """`Scoring`: log-probs by a full forward with training numerics (the log-prob service)."""
    weight_update: Literal["staged", "in_place"] = "staged"
    """`staged`: receive into a second copy, swap between steps; `in_place`: pause, update, resume."""
    batch_invariant: bool = False
    """A token's numbers do not depend on its batch; decode and scoring agree bitwise."""
    versioned_weights: bool = False
    """`VersionedWeights`: prepare a version off the engine loop, install it by a swap, hold
    older versions for scoring until they are dropped."""
    role_handover: bool = False
    """`RoleHandover`: the engine hands its accelerator memory to the training role at a flip
    and takes it back; otherwise a flip leaves the engine as it is."""
    update_ranks: Count = 0
    """`CollectiveUpdate` when > 0: the ranks the cell adds to a version's update group when it
    receives versions through its engine's own collective (SGLang: tp ranks, plus the scoring
    copy). 0: the cell receives the trainer's bucketed broadcast itself (embedded engine)."""
    kv_store: str | None = None
    """Identity of a shared hierarchical KV store the engine reads and writes (SGLang HiCache
    with a storage backend); two cells with the same identity can move a request by the
    `kv_store` path. None: no shared store."""
    block_size: int = 16
    """Tokens per KV block or page (sizes `reserve_tokens` headroom)."""
    vocab_size: int = 0
    """Ids the model takes (0: unknown); a token id at or past it is refused before placement.
    Every cell of a fleet reports the same model limits."""
    max_context: int = 0
    """Most tokens (prompt plus generation) one request may hold (0: unknown)."""
    output_ranges: tuple[tuple[int, int], ...] | None = None
    """Half-open id ranges the model samples from (None: the whole vocabulary)."""


@dataclass
class RegisterRequest(Message):
    cell_id: str
    incarnation: str
    address: str
    """host:port where peers reach the cell's agent."""
    store_port: int
    """Port of the cell's torch.distributed store for per-pair transfer groups."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    kv_blocks_total: int = 0
    max_running: int = 1
    version: int | None = None
    """Weight version the cell holds now."""
    node: str | None = None
    """The machine the cell runs on, as its launcher names it (Ray: node IP and node id);
    shown to operators (`GET /v1/cells` `capabilities.node`, the live view), read by no decision."""
    probe: list[float] | None = None
    """Log-probs of `scheduler.contract.probe.probe_tokens(version, ...)` by the cell's scoring
    path (None: it cannot score): how the scheduler tells a cell that runs the model from one
    that claims to."""
    model: str | None = None
    """The model the cell runs, as configured (its preset name, or its checkpoint or model path;
    `config.engine.served_model`): a cell serves only RL jobs of that model (None: not told)."""
    job: str | None = None
    """The RL job the cell registers into (`cellflip cell --job`; None: the job it was in, a new
    cell `default`). An unknown or draining job, or one of another model, refuses the cell."""


@dataclass
class RegisterResponse(Message):
    generation: int
    lease_s: float
    heartbeat_s: float


# ---------------------------------------------------------------- sync


@dataclass
class Summary(Message):
    """A cell's heartbeat view: its engine's `summary()`, with the role and the loads the
    agent adds."""

    inflight: int = 0
    kv_blocks_used: int = 0
    """Blocks held by requests (an engine without KV accounting: 0, with a total of 0)."""
    kv_blocks_total: int = 0
    version: int | None = None
    """The version served (None: no complete version)."""
    request_ids: list[str] = field(default_factory=list)
    """Every request the cell holds (decoding, stopped for migration, or imported)."""
    role: Literal["rollout", "training"] | None = None
    """The role the cell is ready for (after set_role completes); set by the agent."""
    versions_held: list[int] = field(default_factory=list)
    """Weight versions in memory (the served one and older ones kept for scoring)."""
    loading: list[int] = field(default_factory=list)
    """Versions being received now; set by the agent."""
    parked: list[str] = field(default_factory=list)
    """Requests suspended here with their KV in host memory."""
    kv_blocks_cached: int = 0
    """Blocks held by cached prefixes (reclaimable; not in `kv_blocks_used`)."""
    max_running: int = 1
    """Most requests the engine decodes at once."""
    block_size: int = 16
    """Tokens per KV block or page."""


@dataclass
class TokenBatch(Message):
    request_id: str
    epoch: int
    start: int
    records: TokenRecords = field(default_factory=TokenRecords)
    finish_reason: str | None = None
    """Set with the last batch of a request ("stop", "length", ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.records, TokenRecords):
            self.records = TokenRecords.of(self.records)


@dataclass
class SyncRequest(Message):
    incarnation: str
    summary: Summary = field(default_factory=Summary)
    tokens: list[TokenBatch] = field(default_factory=list)
    events: list[AnyEvent] = field(default_factory=list)
    wait_s: float = 0.0


@dataclass
class SyncResponse(Message):
    commands: list[AnyCommand] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- migrations


@dataclass
class Tail(Message):
    start: int = 0
    records: TokenRecords = field(default_factory=TokenRecords)

    def __post_init__(self) -> None:
        if not isinstance(self.records, TokenRecords):
            self.records = TokenRecords.of(self.records)


@dataclass
class CommitRequest(Message):
    """Sent by the destination after importing the KV, before it resumes decoding."""

    cell_id: str
    incarnation: str
    request_id: str
    epoch: int
    """The epoch the source owned the request at (the commit moves it to epoch + 1)."""
    num_tokens: int
    """Generated tokens the destination holds (= tail.start + len(tail.records))."""
    tail: Tail = field(default_factory=Tail)
    """Records the source produced that it may not have synced yet (merged idempotently)."""
    path: str | None = None
    """"kv" or "kv_store" as actually used; defaults to the path the scheduler chose."""


@dataclass
class CommitResponse(Message):
    epoch: int


@dataclass
class AbortMigrationRequest(Message):
    cell_id: str
    incarnation: str
    reason: str = ""


_COMMAND = TypeAdapter(AnyCommand)
_EVENT = TypeAdapter(AnyEvent)


def _decode(adapter: TypeAdapter, d: Any, what: str) -> Any:
    try:
        return adapter.validate_python(d)
    except ValidationError as e:
        raise ProtocolError(f"bad {what}: {e.errors(include_url=False, include_input=False)}") from None


def decode_command(d: Mapping[str, Any]) -> Command:
    """One command from its JSON form (a sync response decodes its commands itself)."""
    return _decode(_COMMAND, d, "command")


def decode_event(d: Mapping[str, Any]) -> Message:
    """One event from its JSON form (a sync request decodes its events itself)."""
    return _decode(_EVENT, d, "event")


def dispatch(handlers: Mapping[str, Callable[[Any], Any]], msg: Any) -> Any:
    """Route a decoded command or event to `handlers[msg.type]` (the type→handler table)."""
    return handlers[msg.type](msg)

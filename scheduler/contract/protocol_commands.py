"""Commands (scheduler → cell) and events (cell → scheduler) of the cell protocol.

Every command carries a `cmd_id` (growing across scheduler restarts) and is delivered once, in
order, in a SyncResponse; every event rides in a SyncRequest. Each message names its kind in
its `type` field (a `Literal`: on the wire `"type": "start"`, as always); `AnyCommand` and
`AnyEvent` are the discriminated unions the sync messages carry, so a message is validated
once, where it enters (the cell protocol's routes, the cell's client), and `COMMANDS` and
`EVENTS` are their type → class tables. See `scheduler.contract.protocol` for the rules
around them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from pydantic import Field

from scheduler.contract.protocol_base import Message
from scheduler.contract.sampling import SamplingParams

Count = Annotated[int, Field(ge=0)]
"""An index, a length, an epoch, a version number, a byte count: never negative."""

# ---------------------------------------------------------------- commands (scheduler → cell)


@dataclass
class Command(Message):
    cmd_id: Count


@dataclass
class StartCmd(Command):
    """Start a request, or resume one by re-prefill: continue at generated index num_generated.

    token_ids = prompt + tokens generated so far; prompt_len = len(prompt); params: max_tokens
    counts every generated token, including the first num_generated.

    A sticky turn (the session's previous turn ended on this cell) sends only what is new:
    `prefix_hash` set, the context is the session's `prefix_len` tokens this cell holds
    (scheduler/contract/prefixhash.py digest `prefix_hash`) followed by `token_ids`, and
    `prompt_len` counts the whole context's prompt. A cell that does not hold that prefix
    answers `PrefixMissingEvent` and starts nothing; the scheduler sends the full context."""

    request_id: str
    epoch: Count
    session_id: str
    token_ids: list[int]
    prompt_len: Count
    num_generated: Count
    params: SamplingParams
    path: Literal["reprefill", "kv_store"] | None = None
    """How a moved request came here: "reprefill" or "kv_store" (the destination's prefix
    match may load the shared store's blocks); None for a request placed afresh."""
    prefix_len: Count = 0
    """Tokens of the context the cell holds already (a delta start; 0: token_ids is all)."""
    prefix_hash: str | None = None
    """Digest of those `prefix_len` tokens; None: a full start."""

    type: Literal["start"] = field(default="start", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):  # its JSON form, as a request row keeps it
            self.params = SamplingParams.model_validate(self.params)


@dataclass
class MigrateOutCmd(Command):
    """To the source: copy the request's KV to dest_cell while decoding, stop-and-copy, hand over."""

    request_id: str
    epoch: Count
    migration_id: str
    dest_cell: str
    dest_address: str
    dest_store_port: int
    type: Literal["migrate_out"] = field(default="migrate_out", init=False)


@dataclass
class MigrateInCmd(Command):
    """To the destination: reserve reserve_tokens of KV, import, then commit before resuming."""

    request_id: str
    migration_id: str
    src_cell: str
    src_address: str
    src_store_port: int
    reserve_tokens: Count
    epoch: Count = 0
    """Epoch the source owns the request at (the value to send in CommitRequest.epoch)."""
    type: Literal["migrate_in"] = field(default="migrate_in", init=False)


@dataclass
class AbortCmd(Command):
    """Drop the request and free its blocks (it is owned elsewhere, finished, or dropped)."""

    request_id: str
    type: Literal["abort"] = field(default="abort", init=False)


@dataclass
class SuspendCmd(Command):
    """Stop the request. `park`: keep its KV in host memory (the cell stays its owner and it
    moves on later by KV migration); otherwise free everything (re-prefilled later)."""

    request_id: str
    park: bool = False
    type: Literal["suspend"] = field(default="suspend", init=False)


@dataclass
class SetRoleCmd(Command):
    """Become `role` ("training" or "rollout", the latter after loading the current version);
    idempotent; completion is reported through Summary.role."""

    role: Literal["training", "rollout"]
    flip_id: str
    version: Count | None = None
    """For role "rollout": the weight version to load (None: keep the held one)."""
    source: dict | None = None
    """For role "training": the trainer's store ({"host", "port"}, its registered version
    host), where the cell's training rank takes its steps."""
    type: Literal["set_role"] = field(default="set_role", init=False)


@dataclass
class LoadVersionCmd(Command):
    """Get weight version `version` from the trainer's version host at `source`:
    "broadcast" joins the trainer's broadcast of it, "fetch" catches up point-to-point (a cell
    that missed the broadcast, or enters rollout later). `activate`: serve it once verified
    (between engine steps, under `inflight_policy`); otherwise hold it for scoring only."""

    version: Count
    source: dict
    mode: Literal["broadcast", "fetch"] = "broadcast"
    activate: bool = True
    inflight_policy: Literal["keep_kv", "recompute"] = "keep_kv"
    type: Literal["load_version"] = field(default="load_version", init=False)


@dataclass
class ScoreCmd(Command):
    """Log-prob service: score the sampled tokens of `version` at session indices
    [start, end) with that version's weights; `token_ids` is the context from session index
    `context_start` up to `end`. Answered by a ScoredEvent with the same task id."""

    task_id: str
    session_id: str
    version: Count
    context_start: Count
    start: Count
    end: Count
    token_ids: list[int]
    temperature: float = 1.0
    urgent: bool = False
    """Part of a final pass (a version its holder no longer serves): run at normal priority."""
    type: Literal["score"] = field(default="score", init=False)


@dataclass
class DropVersionCmd(Command):
    """Every token of `version` this cell could score is scored (or the version is retired):
    free its weights. Never the version the cell serves."""

    version: Count
    type: Literal["drop_version"] = field(default="drop_version", init=False)


@dataclass
class CancelMigrationCmd(Command):
    """The migration was aborted: the source resumes decoding (it is still the owner), the
    destination frees its reservation and must not commit."""

    request_id: str
    migration_id: str
    type: Literal["cancel_migration"] = field(default="cancel_migration", init=False)


@dataclass
class ExportCmd(Command):
    """Write held weight version `version` as a Hugging Face directory at `path`, relative to
    the cell's `cells.export_root` (scheduler/contract/exports.py); answered by an
    ExportedEvent with the same export id."""

    export_id: str
    version: Count
    path: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    type: Literal["export"] = field(default="export", init=False)


AnyCommand = Annotated[StartCmd | MigrateOutCmd | MigrateInCmd | AbortCmd | SuspendCmd | SetRoleCmd
                       | CancelMigrationCmd | LoadVersionCmd | ScoreCmd | DropVersionCmd | ExportCmd,
                       Field(discriminator="type")]
"""A command, told apart by its `type`."""
COMMANDS: dict[str, type[Command]] = {c.type: c for c in get_args(get_args(AnyCommand)[0])}


# ---------------------------------------------------------------- events (cell → scheduler)


@dataclass
class MigrationEvent(Message):
    """Data-plane report of one migration, sent once by the destination (by the source when the
    destination never got it). Feeds bytes; outcomes are counted at the CAS, and the client-visible
    stall is measured on the scheduler's own token stream (scheduler/control/stallmeter.py)."""

    migration_id: str
    outcome: str
    path: Literal["kv", "kv_store", "reprefill"] = "kv"
    bytes: Count = 0
    type: Literal["migration"] = field(default="migration", init=False)


@dataclass
class ScoredEvent(Message):
    """Old log-probs for session tokens [start, start + len(old_logprobs)) (sampled ones only)."""

    session_id: str
    start: Count
    old_logprobs: list[float | None]
    provenance: Literal["exact", "missing"] = "exact"
    """"exact" or "missing" (exact scoring became impossible)."""
    version: int | None = None
    """Only tokens sampled under this version are written (None: any sampled token)."""
    task_id: str | None = None
    seconds: float = 0.0
    """Scoring time on the cell (the scoring cost the bench reports)."""
    type: Literal["scored"] = field(default="scored", init=False)


@dataclass
class BroadcastEvent(Message):
    """A weight version arrived (or failed to) on this cell."""

    version: int
    seconds: float
    ok: bool = True
    reason: str = ""
    mode: Literal["broadcast", "fetch", "local"] = "broadcast"
    """How it came: "broadcast", "fetch" (point-to-point catch-up) or "local" (this cell
    computed it as a training rank; checksum-verified, nothing received)."""
    activate: bool = True
    """False: fetched for scoring only."""
    pause_s: float = 0.0
    """Engine-loop time the installation took (decoding paused for it)."""
    type: Literal["broadcast"] = field(default="broadcast", init=False)


@dataclass
class PrefixMissingEvent(Message):
    """A delta `StartCmd` named a prefix this cell does not hold (never held, evicted, moved,
    or held at another length or digest): nothing was started; the scheduler sends the
    request's full context (same epoch)."""

    request_id: str
    epoch: Count
    held: Count = 0
    """Tokens of the session the cell holds (0: none)."""
    type: Literal["prefix_missing"] = field(default="prefix_missing", init=False)


@dataclass
class RoleFailedEvent(Message):
    """set_role could not complete (e.g. the weights did not load): the flip rolls back."""

    flip_id: str
    reason: str = ""
    type: Literal["role_failed"] = field(default="role_failed", init=False)


@dataclass
class ExportedEvent(Message):
    """An export (ExportCmd) was written, or could not be."""

    export_id: str
    version: int
    ok: bool
    path: str = ""
    """Where it was written, as the cell resolved it."""
    reason: str = ""
    seconds: float = 0.0
    bytes: Count = 0
    type: Literal["exported"] = field(default="exported", init=False)


AnyEvent = Annotated[MigrationEvent | ScoredEvent | BroadcastEvent | RoleFailedEvent | ExportedEvent
                     | PrefixMissingEvent,
                     Field(discriminator="type")]
"""An event, told apart by its `type`."""
EVENTS: dict[str, type[Message]] = {e.type: e for e in get_args(get_args(AnyEvent)[0])}

"""Commands (scheduler → cell) and events (cell → scheduler) of the cell protocol.

Every command carries a `cmd_id` (growing across scheduler restarts) and is delivered once, in
order, in a SyncResponse; every event rides in a SyncRequest. `COMMANDS` and `EVENTS` are the
type → class tables; see `scheduler.contract.protocol` for the rules around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from scheduler.contract.protocol_base import Message
from scheduler.contract.sampling import SamplingParams

# ---------------------------------------------------------------- commands (scheduler → cell)


@dataclass
class Command(Message):
    cmd_id: int


@dataclass
class StartCmd(Command):
    """Start a request, or resume one by re-prefill: continue at generated index num_generated.

    token_ids = prompt + tokens generated so far; prompt_len = len(prompt); params: max_tokens
    counts every generated token, including the first num_generated."""

    TYPE: ClassVar[str] = "start"
    request_id: str
    epoch: int
    session_id: str
    token_ids: list[int]
    prompt_len: int
    num_generated: int
    params: SamplingParams
    path: str | None = None
    """How a moved request came here: "reprefill" or "kv_store" (the destination's prefix
    match may load the shared store's blocks); None for a request placed afresh."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):  # its JSON form, as a request row keeps it
            self.params = SamplingParams.model_validate(self.params)


@dataclass
class MigrateOutCmd(Command):
    """To the source: copy the request's KV to dest_cell while decoding, stop-and-copy, hand over."""

    TYPE: ClassVar[str] = "migrate_out"
    request_id: str
    epoch: int
    migration_id: str
    dest_cell: str
    dest_address: str
    dest_store_port: int


@dataclass
class MigrateInCmd(Command):
    """To the destination: reserve reserve_tokens of KV, import, then commit before resuming."""

    TYPE: ClassVar[str] = "migrate_in"
    request_id: str
    migration_id: str
    src_cell: str
    src_address: str
    src_store_port: int
    reserve_tokens: int
    epoch: int = 0
    """Epoch the source owns the request at (the value to send in CommitRequest.epoch)."""


@dataclass
class AbortCmd(Command):
    """Drop the request and free its blocks (it is owned elsewhere, finished, or dropped)."""

    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass
class SuspendCmd(Command):
    """Stop the request. `park`: keep its KV in host memory (the cell stays its owner and it
    moves on later by KV migration); otherwise free everything (re-prefilled later)."""

    TYPE: ClassVar[str] = "suspend"
    request_id: str
    park: bool = False


@dataclass
class SetRoleCmd(Command):
    """Become `role` ("training" or "rollout", the latter after loading the current version);
    idempotent; completion is reported through Summary.role."""

    TYPE: ClassVar[str] = "set_role"
    role: str
    flip_id: str
    version: int | None = None
    """For role "rollout": the weight version to load (None: keep the held one)."""


@dataclass
class LoadVersionCmd(Command):
    """Get weight version `version` from the trainer's version host at `source`:
    "broadcast" joins the trainer's broadcast of it, "fetch" catches up point-to-point (a cell
    that missed the broadcast, or enters rollout later). `activate`: serve it once verified
    (between engine steps, under `inflight_policy`); otherwise hold it for scoring only."""

    TYPE: ClassVar[str] = "load_version"
    version: int
    source: dict
    mode: str = "broadcast"
    activate: bool = True
    inflight_policy: str = "keep_kv"


@dataclass
class ScoreCmd(Command):
    """Log-prob service: score the sampled tokens of `version` at session indices
    [start, end) with that version's weights; `token_ids` is the context from session index
    `context_start` up to `end`. Answered by a ScoredEvent with the same task id."""

    TYPE: ClassVar[str] = "score"
    task_id: str
    session_id: str
    version: int
    context_start: int
    start: int
    end: int
    token_ids: list[int]
    temperature: float = 1.0
    urgent: bool = False
    """Part of a final pass (a version its holder no longer serves): run at normal priority."""


@dataclass
class DropVersionCmd(Command):
    """Every token of `version` this cell could score is scored (or the version is retired):
    free its weights. Never the version the cell serves."""

    TYPE: ClassVar[str] = "drop_version"
    version: int


@dataclass
class CancelMigrationCmd(Command):
    """The migration was aborted: the source resumes decoding (it is still the owner), the
    destination frees its reservation and must not commit."""

    TYPE: ClassVar[str] = "cancel_migration"
    request_id: str
    migration_id: str


@dataclass
class ExportCmd(Command):
    """Write held weight version `version` as a Hugging Face directory at `path`, relative to
    the cell's `cells.export_root` (scheduler/contract/exports.py); answered by an
    ExportedEvent with the same export id."""

    TYPE: ClassVar[str] = "export"
    export_id: str
    version: int
    path: str
    dtype: str = "float32"


COMMANDS: dict[str, type[Command]] = {
    c.TYPE: c for c in (StartCmd, MigrateOutCmd, MigrateInCmd, AbortCmd, SuspendCmd, SetRoleCmd, CancelMigrationCmd,
                        LoadVersionCmd, ScoreCmd, DropVersionCmd, ExportCmd)
}


# ---------------------------------------------------------------- events (cell → scheduler)


@dataclass
class MigrationEvent(Message):
    """Data-plane report of one migration, sent once by the destination (by the source when the
    destination never got it). Feeds bytes; outcomes are counted at the CAS, and the client-visible
    stall is measured on the scheduler's own token stream (scheduler/control/stallmeter.py)."""

    TYPE: ClassVar[str] = "migration"
    migration_id: str
    outcome: str
    path: str = "kv"
    bytes: int = 0


@dataclass
class ScoredEvent(Message):
    """Old log-probs for session tokens [start, start + len(old_logprobs)) (sampled ones only)."""

    TYPE: ClassVar[str] = "scored"
    session_id: str
    start: int
    old_logprobs: list[float | None]
    provenance: str = "exact"
    """"exact" or "missing" (exact scoring became impossible)."""
    version: int | None = None
    """Only tokens sampled under this version are written (None: any sampled token)."""
    task_id: str | None = None
    seconds: float = 0.0
    """Scoring time on the cell (the scoring cost the bench reports)."""


@dataclass
class BroadcastEvent(Message):
    """A weight version arrived (or failed to) on this cell."""

    TYPE: ClassVar[str] = "broadcast"
    version: int
    seconds: float
    ok: bool = True
    reason: str = ""
    mode: str = "broadcast"
    """How it came: "broadcast", "fetch" (point-to-point catch-up) or "local" (this cell
    computed it as a training rank; checksum-verified, nothing received)."""
    activate: bool = True
    """False: fetched for scoring only."""
    pause_s: float = 0.0
    """Engine-loop time the installation took (decoding paused for it)."""


@dataclass
class RoleFailedEvent(Message):
    """set_role could not complete (e.g. the weights did not load): the flip rolls back."""

    TYPE: ClassVar[str] = "role_failed"
    flip_id: str
    reason: str = ""


@dataclass
class ExportedEvent(Message):
    """An export (ExportCmd) was written, or could not be."""

    TYPE: ClassVar[str] = "exported"
    export_id: str
    version: int
    ok: bool
    path: str = ""
    """Where it was written, as the cell resolved it."""
    reason: str = ""
    seconds: float = 0.0
    bytes: int = 0


EVENTS: dict[str, type[Message]] = {e.TYPE: e for e in (MigrationEvent, ScoredEvent, BroadcastEvent, RoleFailedEvent,
                                                        ExportedEvent)}

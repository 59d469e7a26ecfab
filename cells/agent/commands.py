"""The scheduler's commands on a cell, routed by type (`scheduler.contract.protocol.dispatch`).

Every handler runs on the sync loop under the engine lock, between two engine steps. What an
engine can do is read from its `Capabilities`: a command it cannot carry out is refused the
way the scheduler expects (a park it cannot do drops the request for a re-prefill; a role
flip it refuses rolls the flip back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from cells.agent.host import CommandsHost
from cells.agent.owned import Owned
from cells.engine.base import kv_handover, role_handover, scoring, versioned_weights
from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model_spec import resolve_spec
from cells.engine.records import EngineError
from cells.transport.store import StoreAddress
from scheduler.contract.exports import resolve_export_path
from scheduler.contract.protocol import (
    AbortCmd,
    CancelMigrationCmd,
    Command,
    DropVersionCmd,
    ExportCmd,
    ExportedEvent,
    LoadVersionCmd,
    MigrateInCmd,
    MigrateOutCmd,
    PrefixMissingEvent,
    RoleFailedEvent,
    ScoreCmd,
    SetRoleCmd,
    StartCmd,
    SuspendCmd,
    dispatch,
)

log = logging.getLogger("cellflip.cell")


class Commands:
    """The cell's command handlers (one per command type)."""

    def __init__(self, agent: CommandsHost) -> None:
        self.agent = agent
        moves = agent.moves
        self.table: dict[str, Callable[[Any], None]] = {
            StartCmd.type: self.start,
            MigrateOutCmd.type: moves.migrate_out,
            MigrateInCmd.type: moves.migrate_in,
            CancelMigrationCmd.type: moves.cancel,
            AbortCmd.type: self.abort,
            SuspendCmd.type: self.suspend,
            SetRoleCmd.type: self.set_role,
            LoadVersionCmd.type: self.load_version,
            ScoreCmd.type: self.score,
            DropVersionCmd.type: self.drop_version,
            ExportCmd.type: self.export,
        }

    def handle(self, cmd: Command) -> None:
        """Run one command's handler (decoded with its sync response)."""
        dispatch(self.table, cmd)

    # -- requests ---------------------------------------------------------------------------
    def start(self, cmd: StartCmd) -> None:
        """Start a request: its whole context, or on a sticky turn the context this cell holds
        (checked by length and digest: cells/agent/held.py) and the new tokens; a prefix not
        held here is answered with `prefix_missing` and nothing starts."""
        a = self.agent
        ids = a.held.context(cmd)
        if ids is None:
            log.info("start %s: prefix of %d tokens of %s not held here (hold %d): asking for the whole context",
                     cmd.request_id, cmd.prefix_len, cmd.session_id, a.held.length(cmd.session_id))
            a.events_append(PrefixMissingEvent(cmd.request_id, cmd.epoch, a.held.length(cmd.session_id)))
            return
        try:
            # resume point, KV reuse across the session's turns, and how a moved request came
            a.engine.add_request(cmd.request_id, ids, cmd.params, prompt_len=cmd.prompt_len,
                                 cache_key=cmd.session_id, path=cmd.path,
                                 checked=cmd.prefix_len if cmd.prefix_hash is not None else 0)
        except EngineError as e:
            log.warning("start %s refused: %s", cmd.request_id, e)
            a.owned[cmd.request_id] = Owned(cmd.epoch, cmd.num_generated, finish_reason=f"error: {e}"[:200])
            return
        a.held.began(cmd, ids)
        a.owned[cmd.request_id] = Owned(cmd.epoch, cmd.num_generated)

    def abort(self, cmd: AbortCmd) -> None:
        self.agent.forget(cmd.request_id, abort_engine=True)

    def suspend(self, cmd: SuspendCmd) -> None:
        if cmd.park:
            self._park(cmd.request_id)
        else:
            self.agent.forget(cmd.request_id, abort_engine=True)

    def _park(self, rid: str) -> None:
        """Keep the request's KV in host memory, off the KV pool; its unsynced tokens still
        ship. If the engine cannot park it (finished meanwhile, no KV export), it is dropped
        and the scheduler, no longer seeing it reported, re-prefills it from the store."""
        a = self.agent
        o = a.owned.get(rid)
        try:
            if o is None:
                raise EngineError("nothing to park")
            nbytes = kv_handover(a.engine).park(rid)
        except EngineError as e:
            if o is not None and o.finish_reason:
                return  # it finished first: the finish ships with its last tokens
            log.warning("park %s failed (%s): dropping it for a re-prefill", rid, e)
            a.forget(rid, abort_engine=True)
            return
        o.parked = True
        log.info("parked %s (%d bytes of KV in host memory)", rid, nbytes)

    # -- roles ------------------------------------------------------------------------------
    def set_role(self, cmd: SetRoleCmd) -> None:
        a = self.agent
        if cmd.role == "training":
            if cmd.source:  # the trainer's store: the training rank's steps and jobs meet there
                a.training.source = StoreAddress.from_dict(cmd.source)
            for rid, o in list(a.owned.items()):  # anything else left was suspended by the drain deadline
                if not o.parked:
                    a.forget(rid, abort_engine=True)
            if self._engine_role("training", cmd.flip_id):
                a.role.set("training", f"flip {cmd.flip_id}")
                a.training.enter()  # a rank from the next step boundary
            return
        if a.role.state == "training":
            a.training.leave()  # at a step boundary: the trainer flips back between steps
            a.role.set("loading", f"flip {cmd.flip_id}")
        if self._engine_role("rollout", cmd.flip_id):
            a.role.set("rollout", f"flip {cmd.flip_id}, version {a.engine.version}")
        elif a.role.state == "loading":
            a.role.set("training", f"flip {cmd.flip_id} failed on the engine")

    def _engine_role(self, role: str, flip_id: str) -> bool:
        """Hand the engine's memory over for `role` where the engine does (`RoleHandover`:
        SGLang releases its GPU memory to training and takes it back). False, with a
        `role_failed` event that rolls the flip back, when the engine refuses."""
        a = self.agent
        if not a.engine.capabilities.role_handover:
            return True
        try:
            role_handover(a.engine).enter_role(role)
        except EngineError as e:
            log.warning("cell %s cannot take the %s role: %s", a.cell_id, role, e)
            a.events_append(RoleFailedEvent(flip_id, f"{role}: {e}"[:500]))
            return False
        return True

    # -- versions and scoring ---------------------------------------------------------------
    def held(self) -> list[int]:
        """The versions the engine holds (the served one alone where it keeps no others)."""
        engine = self.agent.engine
        if engine.capabilities.versioned_weights:
            return list(versioned_weights(engine).versions_held)
        return [engine.version]

    def load_version(self, cmd: LoadVersionCmd) -> None:
        a = self.agent
        a.training.source = StoreAddress.from_dict(cmd.source)  # the trainer's store
        a.versions.load(cmd, self.held(), a.engine.version)

    def score(self, cmd: ScoreCmd) -> None:
        engine = self.agent.engine
        held = engine.capabilities.scoring and cmd.version in self.held()
        self.agent.versions.score(cmd, scoring(engine).scorer(cmd.version) if held else None)

    def export(self, cmd: ExportCmd) -> None:
        """Write a held version as a Hugging Face directory below `cells.export_root`, on a
        thread of its own (the weights of a held version never change: no lock is needed past
        taking the reference); answered by an ExportedEvent either way."""
        a = self.agent
        engine = a.engine

        def refuse(reason: str) -> None:
            log.warning("export %s of version %d refused: %s", cmd.export_id, cmd.version, reason)
            a.events_append(ExportedEvent(cmd.export_id, cmd.version, ok=False, reason=reason))

        if not engine.capabilities.versioned_weights:
            return refuse("this cell's engine keeps no weights it can export")
        if cmd.version not in self.held():
            return refuse(f"version {cmd.version} is not held here")
        try:
            target = resolve_export_path(a.cfg.cells.export_root, cmd.path)
        except ValueError as e:
            return refuse(str(e))
        weights = versioned_weights(engine).weights(cmd.version)
        spec, source = resolve_spec(a.cfg.cells.engine.model), a.cfg.cells.engine.model.path

        def write() -> None:
            t0 = time.monotonic()
            try:
                out = save_checkpoint(target, spec, weights, getattr(torch, cmd.dtype), source=source,
                                      version=cmd.version)
            except (OSError, EngineError, AttributeError) as e:
                return refuse(f"writing {target}: {e}")
            size = sum(f.stat().st_size for f in out.iterdir())
            log.info("exported version %d to %s (%d bytes)", cmd.version, out, size)
            a.events_append(ExportedEvent(cmd.export_id, cmd.version, ok=True, path=str(out),
                                          seconds=round(time.monotonic() - t0, 3), bytes=size))

        threading.Thread(target=write, name=f"export-{cmd.export_id}", daemon=True).start()

    def drop_version(self, cmd: DropVersionCmd) -> None:
        engine = self.agent.engine
        if not engine.capabilities.versioned_weights:
            return  # it holds the served version alone
        if cmd.version == engine.version or cmd.version not in self.held():
            return
        try:
            versioned_weights(engine).drop_version(cmd.version)
        except EngineError as e:  # still needed here; the scheduler asks again later
            log.warning("version %d not dropped: %s", cmd.version, e)
            return
        log.info("dropped version %d", cmd.version)

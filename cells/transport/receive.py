"""Weight versions, cell side: receive a version from the trainer's version host
(cells/transport/versions_host.py), broadcast or point to point, or take part in an engine's
update group. Rollout cells use this; none of it needs the trainer package.

One line each:
  broadcast:    `receive_broadcast` (named in the host's broadcast) → verified tensors, or a reason
  catch-up:     `fetch_version` → take a ticket → the host serves it → verified tensors, or an error
  update group: `await_update_group` → this cell's group spec and bucket plan → the engine
                receives through its own collective → `report_update`

Store keys, in the host's own TCPStore (JSON values only, nothing pickled):
  {ns}/bc/{version}/...     the broadcast's control exchange (see cells/transport/broadcast.py)
  {ns}/ug/{version}/...     the update-group exchange of engine-collective cells:
    ready/{a}/{cell}        cell: alive and waiting for attempt a (after a failed attempt it
                            writes ready/{a+1} at once: "retry me", at most `GROUP_RETRIES` times)
    spec/{a}/{cell}         trainer: {"group": UpdateGroup, "buckets": [BucketSpec]}, written
                            before plan/{a} names the cell
    plan/{a}                trainer: {"members": [...], "retry_within_s": s}; members in rank
                            order; an empty list ends the exchange for whoever still waits
    result/{a}/{cell}       cell: {"ok": bool, "reason": str} once its engine is done
  {ns}/catchup/next         ticket counter; a client takes `n = add(next, 1)`
  {ns}/catchup/req/{n}      client: {"cell": cell_id, "version": v}; the server deletes it
                            once read
  pair/{ns}/catchup/{n}/    rendezvous of ticket n's PairChannel (host rank 0, cell rank 1)
On that channel the host first sends a JSON header, {"ok": true} or {"ok": false, "error":
"version 7 is not held (held: [5, 6])"}, then (if ok) the version by `send_version_p2p`.

The cell side returns only tensors whose every bucket matched its CRC32; any other outcome is
an exception (`fetch_version`) or a reason (`receive_broadcast`), never a partial version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import Store

from cells.engine.sglang.weights import BucketSpec, UpdateGroup
from cells.transport.broadcast import WeightReceiver
from cells.transport.catchup import recv_version_p2p
from cells.transport.p2p import PairChannel, TransferError
from cells.transport.staging import StagingBuffers
from cells.transport.store import StoreAddress, connect, get_json, set_json, wait_json

log = logging.getLogger("cellflip.versions")

GROUP_RETRIES = 1
"""Retries a cell asks for after its engine failed an update (a fresh group each). A cell
that cannot take part at all (a refused update) must not hold its peers' retries up, so it
asks only this often; after that it catches up point-to-point."""


class VersionUnavailable(TransferError):
    """The host does not hold the requested version (never put, or dropped already)."""


class Received(NamedTuple):
    """Outcome of `receive_broadcast`: verified tensors, or None and the reason why not."""

    tensors: dict[str, torch.Tensor] | None
    error: str | None


def catchup_key(namespace: str, *parts: object) -> str:
    return "/".join([namespace, "catchup", *map(str, parts)])


def group_key(namespace: str, version: int, *parts: object) -> str:
    return "/".join([namespace, "ug", str(version), *map(str, parts)])


@dataclass(frozen=True)
class UpdateAssignment:
    """A cell's part in one attempt of a version's update group: where to join (its own
    `rank_offset`) and the buckets, in order, that its engine receives."""

    version: int
    attempt: int
    group: UpdateGroup
    buckets: tuple[BucketSpec, ...]
    retry_within_s: float
    """How long to wait for the next attempt's plan after this one failed."""


def fetch_version(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    staging: dict[str, torch.Tensor] | None = None,
    timeout_s: float = 30.0,
    namespace: str = "versions",
    connect_timeout_s: float | None = None,
    buffers: StagingBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """Catches this cell up to `version` from the trainer's version host.

    Returns the tensors (in `staging`, mutated even on failure, or else in a warm buffer of
    `buffers` where one is free, or freshly allocated) only
    after every bucket matched its CRC32. Raises VersionUnavailable if the host does not
    hold the version, ChecksumError on a corrupt bucket, TransferError on any transport
    failure or deadline. `timeout_s` bounds each op; `connect_timeout_s` (default
    `timeout_s`) bounds the wait for the host to take the ticket up, which includes time
    queued behind other cells' catch-ups. Blocks: call it off the engine's step loop.
    """
    store = _connect(address, timeout_s)
    channel = None
    try:
        ticket = store.add(catchup_key(namespace, "next"), 1)
        set_json(store, catchup_key(namespace, "req", ticket), {"cell": cell_id, "version": version})
        wait_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        try:
            channel = PairChannel(store, catchup_key(namespace, ticket), 1,
                                  timeout_s=timeout_s, connect_timeout_s=wait_s)
        except TransferError as e:
            raise TransferError(f"version host {address.host}:{address.port} did not take up "
                                f"catch-up ticket {ticket} within {wait_s}s: {e}") from e
        header = channel.recv_json()
        if not isinstance(header, dict):
            raise TransferError(f"{channel.name}: malformed catch-up header {header!r:.200}")
        if not header.get("ok"):
            raise VersionUnavailable(f"{cell_id}: {header.get('error') or 'refused by the version host'}")
        got, tensors = recv_version_p2p(channel, staging=staging, buffers=buffers)
        if got != version:
            raise TransferError(f"{channel.name}: asked for version {version}, host sent {got}")
        return tensors
    except dist.DistError as e:  # the host's store went away with the trainer
        raise TransferError(f"version host {address.host}:{address.port}: store unreachable: {e}") from e
    finally:
        if channel is not None:
            channel.close()
        del store  # a TCPStore client's socket closes with the object


def receive_broadcast(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    staging: dict[str, torch.Tensor] | None = None,
    timeout_s: float = 30.0,
    join_timeout_s: float = 60.0,
    namespace: str = "versions",
    buffers: StagingBuffers | None = None,
) -> Received:
    """Receives `version` from the host's `broadcast` naming this cell.

    Returns `Received(tensors, None)` once every bucket matched its CRC32, or
    `Received(None, reason)` (not planned in, sender gone, checksum mismatch, store
    unreachable...): the cell then keeps its old version and catches up with
    `fetch_version`. Never raises for a transfer failure. `staging` is mutated even on
    failure; without it the version lands in a warm buffer of `buffers` where one is free.
    """
    try:
        store = _connect(address, timeout_s)
    except TransferError as e:
        log.warning("%s: version %d broadcast: %s", cell_id, version, e)
        return Received(None, str(e))
    try:
        rx = WeightReceiver(store, cell_id, timeout_s=timeout_s, join_timeout_s=join_timeout_s,
                            namespace=f"{namespace}/bc", buffers=buffers)
        if rx.receive_version(version, staging):
            return Received(rx.received_tensors(), None)
        reason = rx.last_error or "not received"
        log.warning("%s: version %d broadcast not received: %s", cell_id, version, reason)
        return Received(None, reason)
    finally:
        del store


def await_update_group(
    address: StoreAddress,
    cell_id: str,
    version: int,
    *,
    attempt: int = 0,
    wait_s: float = 60.0,
    timeout_s: float = 30.0,
    namespace: str = "versions",
) -> tuple[UpdateAssignment | None, str | None]:
    """Tells the trainer that this cell waits for attempt `attempt` of `version`'s update
    group (after a failed attempt: asks for a retry), and waits at most `wait_s` for the plan.

    Returns `(assignment, None)` when this cell is a member: its engine then joins
    `assignment.group` and receives `assignment.buckets`, and the cell reports with
    `report_update`. Otherwise `(None, reason)` (not planned in, trainer gone, malformed plan,
    store unreachable): the cell keeps its version and catches up with `fetch_version`.
    Never raises for a transfer failure. Blocks: call it off the engine's step loop.
    """
    try:
        store = _connect(address, timeout_s)
    except TransferError as e:
        return None, str(e)
    key = lambda *p: group_key(namespace, version, *p)  # noqa: E731
    try:
        set_json(store, key("ready", attempt, cell_id), {})
        plan = wait_json(store, key("plan", attempt), wait_s)
        if plan is None:
            return None, f"no update plan for attempt {attempt} within {wait_s:.1f}s (trainer gone)"
        if cell_id not in plan["members"]:
            return None, f"not in the update plan of attempt {attempt}"
        spec = get_json(store, key("spec", attempt, cell_id))
        group = UpdateGroup(**spec["group"])
        buckets = tuple(BucketSpec.from_dict(b) for b in spec["buckets"])
        return UpdateAssignment(version, attempt, group, buckets, float(plan["retry_within_s"])), None
    except dist.DistError as e:  # the trainer's store went away with the trainer
        return None, f"store unreachable: {e}"
    except (KeyError, TypeError, ValueError) as e:  # a trainer speaking another protocol
        return None, f"malformed update plan: {e!r}"
    finally:
        del store


def report_update(
    address: StoreAddress,
    cell_id: str,
    assignment: UpdateAssignment,
    ok: bool,
    reason: str = "",
    *,
    timeout_s: float = 30.0,
    namespace: str = "versions",
) -> bool:
    """Tells the trainer how this cell's engine ended `assignment` (final: a cell that wants
    another attempt calls `await_update_group` with the next attempt instead). Returns False
    if the trainer could not be told (it then counts the cell as silent)."""
    try:
        store = _connect(address, timeout_s)
        key = group_key(namespace, assignment.version, "result", assignment.attempt, cell_id)
        set_json(store, key, {"ok": bool(ok), "reason": reason[:500]})
        return True
    except (TransferError, dist.DistError) as e:
        log.warning("%s: version %d: could not report the update: %s", cell_id, assignment.version, e)
        return False


def _connect(address: StoreAddress, timeout_s: float) -> Store:
    try:
        return connect(address, timeout_s=timeout_s)
    except dist.DistError as e:
        raise TransferError(f"version host {address.host}:{address.port}: store unreachable: {e}") from e

"""The handshake of a live migration: what the two cells say to each other over their pair
channel, one small dataclass per message, JSON on the wire (`PairChannel.send_json`), never
pickle. The keys are those the handshake always had, so cells of either release migrate
between each other.

    source → destination   Hello        the request and its length now: reserve for it
    destination → source   Reservation  reserved, or not (no room; or `aborted`, which reads as not)
    source → destination   KVRound      one copy round's header; its blocks follow as one tensor
    destination → source   Ready        (a round with blocks) the receive is posted: send
    source → destination   Final        the stop-and-copy: the last blocks' header, the ids added
                                        since the last round and the request's snapshot
    destination → source   Verdict      `committed` at an epoch, or `aborted` with the reason
    source → destination   Abort        instead of the next round: the migration is off
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import Field, TypeAdapter, ValidationError

from cells.engine.records import RequestSnapshot
from cells.transport.p2p import PairChannel, TransferError
from scheduler.contract.protocol_base import Message, ProtocolError

Count = Annotated[int, Field(ge=0)]
KVDtype = Literal["float32", "bfloat16"]
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Hello(Message):
    request_id: str
    num_tokens: Count


@dataclass
class Reservation(Message):
    reserved: bool = False


@dataclass
class KVRound(Message):
    start: Count
    """First block of the round."""
    shape: list[Count]
    """Shape of the tensor that follows (no tensor when it has no elements)."""
    token_ids_from: Count
    token_ids: list[int]
    """The request's token ids from `token_ids_from` on, added since the last round."""
    dtype: KVDtype = "float32"
    """Element type of the tensor that follows (the source's KV pool's)."""
    kind: Literal["kv"] = field(default="kv", init=False)


@dataclass
class Final(Message):
    start: Count
    shape: list[Count]
    token_ids_from: Count
    token_ids: list[int]
    snapshot: RequestSnapshot
    """The request's state, with its unsynced records (its token ids travel above)."""
    dtype: KVDtype = "float32"
    kind: Literal["final"] = field(default="final", init=False)


@dataclass
class Abort(Message):
    kind: Literal["abort"] = field(default="abort", init=False)


@dataclass
class Ready(Message):
    ready: bool = False


@dataclass
class Verdict(Message):
    committed: int | None = None
    """The epoch the destination owns the request at."""
    aborted: str | None = None


Round = Annotated[KVRound | Final | Abort, Field(discriminator="kind")]
_ROUND = TypeAdapter(Round)
M = TypeVar("M", bound=Message)


def send(ch: PairChannel, msg: Message) -> None:
    ch.send_json(msg.to_dict())


def receive(ch: PairChannel, kind: type[M]) -> M:
    """The next message, read as `kind`; a malformed one fails the transfer."""
    return _checked(lambda: kind.from_dict(_object(ch.recv_json())))


def receive_round(ch: PairChannel) -> KVRound | Final | Abort:
    """The source's next message to a destination importing rounds."""
    return _checked(lambda: _ROUND.validate_python(ch.recv_json()))


def _object(got: Any) -> dict:
    if not isinstance(got, dict):
        raise ProtocolError(f"a migration message is a JSON object, got {str(got)[:200]}")
    return got


def _checked(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (ProtocolError, ValidationError) as e:
        raise TransferError(f"malformed migration message: {str(e)[:500]}") from None

"""Data-plane rendezvous: the TCPStore that a cell (or the trainer) hosts for its transfers.

Every process that originates transfers hosts one store; a group that it forms rendezvouses
under a unique prefix there. The scheduler never touches these stores: data-plane rendezvous
lives with the cells that transfer (DESIGN "Layout"), so the control plane needs no torch.

Waits here poll `Store.check` instead of calling `Store.wait`/`get`: those block for the
client's construction-time timeout and log a warning each time they give up, while a control
exchange needs its own short deadline per call and a plain "not there yet" answer. A poll
starts short and backs off (`poll_sleeps`): most control keys appear within milliseconds of
the wait (a peer's reply, a report after the last bucket), and a flat 10 ms period would add
5 ms on average to each such step of a transfer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import Store, TCPStore

POLL_S = 0.01
"""Longest poll period of the bounded waits: short against any transfer timeout, cheap for the
store."""
FIRST_POLL_S = 0.0005
"""First poll period; each next one is twice as long, up to `POLL_S`."""


def poll_sleeps(deadline: float, longest: float = POLL_S):
    """Sleeps between the checks of a bounded wait: yields before each check after the first,
    False once `deadline` (monotonic) has passed. The period doubles from `FIRST_POLL_S` to
    `longest`: a key that appears t seconds into the wait is seen within about t more."""
    period = FIRST_POLL_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            yield False
            return
        time.sleep(min(period, left))
        period = min(period * 2, longest)
        yield True


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a cell's rendezvous store listens; travels in JSON messages."""

    host: str
    port: int

    def to_dict(self) -> dict:
        return {"host": self.host, "port": self.port}

    @classmethod
    def from_dict(cls, d: dict) -> StoreAddress:
        return cls(host=str(d["host"]), port=int(d["port"]))


class StoreHost:
    """Hosts the TCPStore of one process; port 0 picks a free port (read it from `address`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> None:
        # wait_for_workers=False: peers come and go for the life of the cell, there is no
        # fixed world to wait for.
        self.store = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.address = StoreAddress(host, self.store.port)

    def close(self) -> None:
        """Drops the listening store; clients still connected see errors on their next call."""
        self.store = None  # type: ignore[assignment]


def connect(address: StoreAddress, *, timeout_s: float = 30.0) -> TCPStore:
    """A client of a peer's store. `timeout_s` bounds the connect and any blocking get."""
    return TCPStore(
        address.host,
        address.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def wait_keys(store: Store, keys: list[str], timeout_s: float) -> list[str]:
    """Waits until every key exists or the deadline passes; returns the keys present by then.

    Never raises on timeout: the caller decides what a missing key means (a dead peer, a late
    one). Does not modify the store.
    """
    present: set[str] = set()
    sleeps = poll_sleeps(time.monotonic() + timeout_s)
    while True:
        for k in keys:
            if k not in present and store.check([k]):
                present.add(k)
        if len(present) == len(keys) or not next(sleeps):
            return [k for k in keys if k in present]


def wait_any(store: Store, keys: list[str], timeout_s: float) -> str | None:
    """The first of `keys` found to exist within the deadline, or None."""
    sleeps = poll_sleeps(time.monotonic() + timeout_s)
    while True:
        for k in keys:
            if store.check([k]):
                return k
        if not next(sleeps):
            return None


JSON_BYTES = {"set": 0, "get": 0}
"""Bytes of JSON this process wrote to and read from stores (a trainer's per-step traffic)."""


def set_json(store: Store, key: str, obj: object) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    JSON_BYTES["set"] += len(data)
    store.set(key, data)


def get_json(store: Store, key: str) -> object:
    """Reads a key known to exist (check it first: a missing key blocks for the client timeout)."""
    data = bytes(store.get(key))
    JSON_BYTES["get"] += len(data)
    return json.loads(data.decode())


def wait_json(store: Store, key: str, timeout_s: float) -> object | None:
    """The key's JSON value once it exists, or None if it did not appear within the deadline."""
    if not wait_keys(store, [key], timeout_s):
        return None
    return get_json(store, key)

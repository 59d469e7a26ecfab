"""A running hash of a token sequence, cheap to extend: what a sticky turn's prefix is checked by.

A session's context is hashed in blocks of `BLOCK` token ids (uint32, little-endian): the
chain value after block k is BLAKE2b(chain value after block k-1 ‖ block k), and the digest
of the whole sequence is BLAKE2b(chain ‖ the partial last block ‖ length). So the digest is a
function of the token ids alone (never of how they arrived: one append or many), extending by
m tokens costs O(m) (full blocks are hashed once), and the state a holder keeps between turns
is one chain value plus fewer than `BLOCK` ids — small enough for a store row as JSON.

The scheduler keeps one per session (scheduler/store/context.py), a cell one per session it
holds (cells/agent/held.py); a sticky turn's `StartCmd` carries the prefix's length and digest
and only the tokens after it, and the cell starts it only when its own digest at that length
is the same (else it asks for the full context: `PrefixMissingEvent`).

At Qwen3-32B on an 8-GPU cell the cost is the same as on the toy model (it hashes ids, not
activations): ~4 bytes × m per turn of m new tokens, ~1 ms for a 128k-token context from
scratch.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

BLOCK = 64
"""Token ids per chained block (the state keeps fewer than this many ids unhashed: a store row
of a few hundred bytes a session)."""

DIGEST_BYTES = 16
_ZERO = bytes(DIGEST_BYTES)


def _bytes(ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes; a negative or oversized id is a ValueError."""
    try:
        a = array("I", ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if sys.byteorder == "big":  # pragma: no cover - the digest is the same on every host
        a.byteswap()
    return a.tobytes()


def _chain(prev: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(prev + block, digest_size=DIGEST_BYTES).digest()


@dataclass(slots=True)
class PrefixHash:
    """The running hash of a token sequence: `length` ids, hashed to `digest()`."""

    length: int = 0
    chain: bytes = _ZERO
    """Chain value over the full blocks so far."""
    tail: list[int] = field(default_factory=list)
    """The ids after the last full block (fewer than BLOCK)."""

    @classmethod
    def of(cls, ids: Sequence[int]) -> PrefixHash:
        h = cls()
        h.extend(ids)
        return h

    def extend(self, ids: Sequence[int]) -> PrefixHash:
        """Append ids (O(len(ids))); returns self."""
        if not ids:
            return self
        pending = self.tail + list(ids) if self.tail else list(ids)
        raw = _bytes(pending)
        full = len(pending) - len(pending) % BLOCK
        step = BLOCK * 4
        chain = self.chain
        for k in range(0, full * 4, step):
            chain = _chain(chain, raw[k:k + step])
        self.chain, self.tail = chain, pending[full:]
        self.length += len(ids)
        return self

    def digest(self) -> str:
        """The sequence's digest (hex): equal for equal sequences, whatever the appends were."""
        final = self.chain + _bytes(self.tail) + self.length.to_bytes(8, "little")
        return hashlib.blake2b(final, digest_size=DIGEST_BYTES).hexdigest()

    def copy(self) -> PrefixHash:
        return PrefixHash(self.length, self.chain, list(self.tail))

    def to_json(self) -> dict[str, Any]:
        return {"n": self.length, "chain": self.chain.hex(), "tail": list(self.tail)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefixHash:
        h = cls(int(d["n"]), bytes.fromhex(d["chain"]), [int(t) for t in d["tail"]])
        if len(h.chain) != DIGEST_BYTES or len(h.tail) >= BLOCK or h.length % BLOCK != len(h.tail):
            raise ValueError(f"not a prefix hash state: n={h.length}, tail of {len(h.tail)}")
        return h


def prefix_digest(ids: Sequence[int]) -> str:
    """The digest of a whole sequence (`PrefixHash.of(ids).digest()`)."""
    return PrefixHash.of(ids).digest()

"""The registration probe: a short token sequence, a pure function of the weight version and
the model's limits, whose log-probs a cell computes with its scoring path and sends when it
registers. Honest cells holding the same version agree (bit for bit where both are
batch-invariant, within a tolerance otherwise); a process that does not run the model cannot.
The scheduler keeps each version's reference answer (scheduler/control/trust.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

PROBE_LEN = 24
"""Tokens in the probe (its answer has PROBE_LEN - 1 log-probs)."""


def probe_tokens(version: int | None, vocab_size: int, output_ranges: Sequence[Sequence[int]] | None) -> list[int]:
    """The probe for `version`: ids the model can sample (its output ranges, else its
    vocabulary), drawn by a generator seeded with the version alone."""
    rng = random.Random(f"cellflip-probe:{version}")
    ranges = [(int(lo), int(hi)) for lo, hi in output_ranges or () if hi > lo] or [(0, max(1, vocab_size))]
    total = sum(hi - lo for lo, hi in ranges)
    out = []
    for _ in range(PROBE_LEN):
        k = rng.randrange(total)
        for lo, hi in ranges:
            if k < hi - lo:
                out.append(lo + k)
                break
            k -= hi - lo
    return out


def well_formed(answer: Sequence[float] | None) -> bool:
    """An answer a model could give: PROBE_LEN - 1 finite log-probs, none above 0."""
    return (answer is not None and len(answer) == PROBE_LEN - 1
            and all(isinstance(x, int | float) and math.isfinite(x) and x <= 0 for x in answer))


def agree(a: Sequence[float], b: Sequence[float], exact: bool, tolerance: float) -> bool:
    """Two answers of the same version agree: bit for bit (`exact`, both cells batch-invariant),
    else within `tolerance` nats at every position."""
    if len(a) != len(b):
        return False
    if exact:
        return all(float(x) == float(y) for x, y in zip(a, b))
    return all(abs(float(x) - float(y)) <= tolerance for x, y in zip(a, b))

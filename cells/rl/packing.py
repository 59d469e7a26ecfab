"""Several sequences per forward: the learner's micro-batch packed without padding.

The sequences of a micro-batch are concatenated into one flat token batch, each its own
segment (positions from 0, attending only to itself: `forward`'s segments), so the matrix
products run once over all their tokens instead of once per sequence; nothing is padded. In
batch-invariant mode (`tile`) a row's numbers do not depend on the rows around it, so the
packed log-probs are bitwise each sequence's own forward's (tested); in fast mode they agree
to float order. `Learner.pack` (on by default) chooses it; bench/train.py measures both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cells.engine.embedded.model import Prepared, Segment, forward, target_logprobs, token_logprobs


def packed_token_logprobs(prep: Prepared, seqs: Sequence[Tensor], temperature: float, tile: int | None,
                          entropy: list | None = None) -> list[Tensor]:
    """`token_logprobs` of each of `seqs` (tokens 1..L-1) from one packed forward; with
    `entropy` (a list) each sequence's entropies are appended to it."""
    lens = [int(s.shape[0]) for s in seqs]
    ids = torch.cat(list(seqs))
    positions = torch.cat([torch.arange(n) for n in lens])
    segments, ends, off = [], [], 0
    for n in lens:
        segments.append(Segment(off, n, 0))
        off += n
        ends.append(off - 1)
    hidden = forward(prep, ids, positions, segments, tile)
    keep = torch.ones(off, dtype=torch.bool)
    keep[torch.tensor(ends, dtype=torch.long)] = False  # a sequence's last token predicts nothing
    src = torch.nonzero(keep).flatten()
    ent: list | None = [] if entropy is not None else None
    lp = target_logprobs(prep, hidden.index_select(0, src), ids.index_select(0, src + 1), temperature, tile, ent)
    sizes = [max(n - 1, 0) for n in lens]
    if entropy is not None:
        entropy.extend(ent[0].split(sizes))
    return list(lp.split(sizes))


def sequence_logprobs(prep: Prepared, seqs: Sequence[Tensor], temperature: float, tile: int | None,
                      entropy: list | None, pack: bool) -> list[Tensor]:
    """Per-token log-probs of each sequence with a 0 for token 0 (the learner's layout), packed
    or one forward per sequence; entropies likewise (0 at token 0) into `entropy`."""
    ents: list | None = [] if entropy is not None else None
    if pack and len(seqs) > 1:
        lps = packed_token_logprobs(prep, seqs, temperature, tile, ents)
    else:
        lps = []
        for ids in seqs:
            e: list | None = [] if ents is not None else None
            lps.append(token_logprobs(prep, ids, temperature, tile, entropy=e))
            if ents is not None:
                ents.append(e[0] if e else lps[-1].new_zeros(0))
    if entropy is not None:
        entropy.extend(torch.cat([h.new_zeros(1), h]) for h in ents)
    return [torch.cat([lp.new_zeros(1), lp]) for lp in lps]

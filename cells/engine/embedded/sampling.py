"""Sampling with noise that is a pure function of (seed, request id, token index).

Gumbel-max over the (optionally top-k / top-p truncated) temperature-scaled distribution.
Because the noise depends only on (seed, request id, t), a request continues identically on
any cell, after a hand-over or a re-prefill, without shipping generator state.
"""

from __future__ import annotations

import hashlib

import torch

from cells.engine.records import SamplingParams


def noise_seed(seed: int, request_id: str, index: int) -> int:
    h = hashlib.blake2b(f"{seed}\x00{request_id}\x00{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def gumbel(seed: int, request_id: str, index: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(noise_seed(seed, request_id, index))
    u = torch.rand(n, generator=g).clamp_(min=1e-20)
    return -torch.log(-torch.log(u))


def truncation_mask(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Boolean mask of kept ids (None when no truncation is active)."""
    keep = None
    n = logprobs.shape[-1]
    if 0 < top_k < n:
        kth = torch.topk(logprobs, top_k).values[-1]
        keep = logprobs >= kth
    if top_p < 1.0:
        probs = logprobs.exp()
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, 0)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        keep_sorted = (cum - sorted_p) < top_p
        kp = torch.zeros(n, dtype=torch.bool, device=logprobs.device)
        kp[order[keep_sorted]] = True
        keep = kp if keep is None else keep & kp
    return keep


def sample(logprobs: torch.Tensor, params: SamplingParams, request_id: str, index: int) -> tuple[int, float, bool]:
    """Pick an output index from one row of temperature-scaled log-probs.

    Returns (output index, its log-prob before truncation, whether truncation was active).
    """
    if params.greedy:
        i = int(torch.argmax(logprobs))
        return i, float(logprobs[i]), False
    keep = truncation_mask(logprobs, params.top_k, params.top_p)
    # The noise is drawn on the host on every device: a request continues identically
    # whichever device it moves to.
    scores = logprobs + gumbel(params.seed, request_id, index, logprobs.shape[0]).to(logprobs.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    i = int(torch.argmax(scores))
    return i, float(logprobs[i]), keep is not None

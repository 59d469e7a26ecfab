"""Log-probs of the sampled tokens without the [T, V] logits.

The output layer turns T hidden rows into T x V logits (V = 151,936 for Qwen3): at T = 8,192
that is 5 GB in fp32, and autograd would keep the log-softmax of it for the backward. Here
the rows go through the output layer in chunks of `rows` (about `CHUNK_BYTES` of logits each):
the forward keeps only each row's target log-prob (and, when asked, its entropy); the
backward recomputes each chunk's softmax and forms the gradient of the hidden rows and of
the output layer from it directly,

    d lp[i, y_i] / d logits[i] = (onehot(y_i) - softmax(logits[i])) / t_i,

so the peak is one or two chunks of logits whatever T is. In batch-invariant mode (`tile`)
the chunks are whole row tiles and each chunk runs `head_logprobs`: the forward's log-probs
are bitwise those of the whole [T, V] computation (a row's numbers do not depend on the rows
around it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cells.engine.embedded.layers import linear

CHUNK_BYTES = 8 << 20
"""Logit bytes per chunk (fp32): about 13 rows at V = 151,936; the whole batch when V is small."""



def head_logprobs(head: torch.Tensor, hidden: torch.Tensor, temperature: float | torch.Tensor,
                  tile: int | None) -> torch.Tensor:
    """Log-probs over the output layer `head` [V_out, hidden]."""
    logits = linear(hidden, head, tile).float()  # log-softmax in float32 (a no-op cast there)
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        logits = logits / t[:, None].to(logits.dtype)
    elif temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()  # the softmax in fp32 whatever the compute precision
    if tile is None:
        return torch.log_softmax(logits, dim=-1)
    # Row-wise reduction on the same fixed, zero-padded tiles as the matmuls.
    n = logits.shape[0]
    pad = (-n) % tile
    if pad:
        logits = torch.cat([logits, logits.new_zeros(pad, logits.shape[1])])
    out = torch.cat([torch.log_softmax(logits[i : i + tile], dim=-1) for i in range(0, n + pad, tile)])
    return out[:n] if pad else out

def chunk_rows(vocab: int, tile: int | None, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: `budget` bytes of fp32 logits, whole row tiles in batch-invariant mode."""
    rows = max(1, budget // (4 * max(vocab, 1)))
    return max(tile, rows // tile * tile) if tile else rows


def _temps(temperature: float | Tensor, n: int, like: Tensor) -> Tensor:
    """One temperature per row, greedy (0) scored at 1."""
    t = temperature if isinstance(temperature, Tensor) else torch.full((n,), float(temperature))
    t = t.to(device=like.device, dtype=torch.float32)
    return torch.where(t > 0, t, torch.ones_like(t))


class _TargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, head: Tensor, idx: Tensor, temps: Tensor, tile: int | None, rows: int,
                entropy: list | None) -> Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if entropy is not None else None
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            lp = head_logprobs(head, hidden[lo:hi], temps[lo:hi], tile)
            out[lo:hi] = lp.gather(1, idx[lo:hi, None])[:, 0]
            if ent is not None:
                ent[lo:hi] = -(lp.exp() * lp.clamp(min=-1e30)).sum(-1)
            del lp
        if entropy is not None:
            entropy.append(ent)
        ctx.save_for_backward(hidden, head, idx, temps)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, head, idx, temps = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if need_w else None
        n, rows = hidden.shape[0], ctx.rows
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            h = hidden[lo:hi]
            scale = (grad[lo:hi].float() / temps[lo:hi])[:, None]
            logits = torch.nn.functional.linear(h, head).float().div_(temps[lo:hi, None])
            gl = torch.softmax(logits, dim=-1)
            del logits
            gl.mul_(-scale)
            gl.scatter_add_(1, idx[lo:hi, None], scale)
            gl = gl.to(hidden.dtype)
            if gh is not None:
                gh[lo:hi] = gl @ head
            if gw is not None:
                gw.addmm_(gl.t().float(), h.float())
            del gl
        return gh, None if gw is None else gw.to(head.dtype), None, None, None, None, None


def chunked_target_logprobs(head: Tensor, hidden: Tensor, idx: Tensor, temperature: float | Tensor,
                            tile: int | None, entropy: list | None = None, rows: int | None = None) -> Tensor:
    """lp[i] = log softmax(hidden[i] @ head.T / t_i)[idx[i]] (fp32), chunked, with the chunked
    recomputing backward; `idx` indexes the rows of `head`. With `entropy` (a list) each row's
    policy entropy is appended to it (detached)."""
    n = hidden.shape[0]
    rows = rows or chunk_rows(head.shape[0], tile)
    return _TargetLogprob.apply(hidden, head, idx, _temps(temperature, n, hidden), tile, rows, entropy)

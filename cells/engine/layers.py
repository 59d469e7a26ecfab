"""Numerical building blocks shared by decode and scoring, in two modes.

Fast mode uses the natural batched kernels. Batch-invariant mode makes every token's numbers
independent of the batch around it *by construction*: every matrix product runs on
fixed-shape row tiles (`row_tile` rows, the last tile zero-padded), and attention runs on
query tiles aligned to absolute positions (tile j holds positions [jT, jT+T) and attends to
keys [0, (j+1)T), later keys masked). A decode step of position p and the cache-free scoring
of the same sequence therefore issue the same kernels with the same shapes, with p's row at
the same place in its tile; only masked or padded entries differ, and those contribute exact
zeros. `probe_row_invariance` checks the one assumption left (a GEMM row does not depend on
the other rows of its tile) at engine start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def linear(x: torch.Tensor, w: torch.Tensor, tile: int | None) -> torch.Tensor:
    """x [N, K] @ w[out, K].T; in batch-invariant mode on fixed [tile, K] row tiles."""
    if tile is None:
        return F.linear(x, w)
    n = x.shape[0]
    pad = (-n) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(x[i : i + tile], w) for i in range(0, n + pad, tile)])
    return out[:n] if pad else out


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] with cos/sin [N, D/2] gathered at each token's position (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, Hkv, D]. Returns [n, H, D]."""
    n, h, d = q.shape
    groups = h // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
    vh = v.repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh)
    elif start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        lk = k.shape[0]
        qpos = torch.arange(start, start + n)[:, None]
        mask = torch.arange(lk)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)


def attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, tile: int) -> torch.Tensor:
    """Batch-invariant attention. Same arguments as `attention_fast`; `k`, `v` may hold fewer
    than (j+1)*tile keys for the last tile (a decode step): they are zero-padded, and masked."""
    n, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scale = d ** -0.5
    first, last = start // tile, (start + n - 1) // tile
    outs = []
    for j in range(first, last + 1):
        lo, hi = j * tile, (j + 1) * tile
        # Query tile: rows are absolute positions lo..hi-1; rows outside this call stay zero.
        qt = q.new_zeros(tile, h, d)
        a, b = max(lo, start), min(hi, start + n)
        qt[a - lo : b - lo] = q[a - start : b - start]
        kt, vt = k[:hi], v[:hi]
        if kt.shape[0] < hi:
            padk = hi - kt.shape[0]
            kt = torch.cat([kt, k.new_zeros(padk, hkv, d)])
            vt = torch.cat([vt, v.new_zeros(padk, hkv, d)])
        # [hkv, g*tile, d] @ [hkv, d, hi]: one bmm per kv head group, fixed shape per tile.
        qg = qt.view(tile, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * tile, d) * scale
        scores = torch.bmm(qg, kt.permute(1, 2, 0).contiguous())
        qpos = torch.arange(lo, hi).repeat(g)[:, None]
        scores = scores.masked_fill(torch.arange(hi)[None, :] > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, vt.permute(1, 0, 2).contiguous())  # [hkv, g*tile, d]
        o = o.view(hkv, g, tile, d).permute(2, 0, 1, 3).reshape(tile, h, d)
        outs.append(o[a - lo : b - lo])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def probe_row_invariance(k: int = 256, n: int = 512, tile: int = 4, trials: int = 8) -> bool:
    """True when a GEMM row on a [tile, k] tile does not depend on its neighbours or its place."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(n, k, generator=g)
    x0 = torch.randn(k, generator=g)
    ref = F.linear(x0.expand(tile, k).contiguous(), w)[0]
    for t in range(trials):
        xt = torch.randn(tile, k, generator=g)
        xt[t % tile] = x0
        if not torch.equal(F.linear(xt, w)[t % tile], ref):
            return False
    return True

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

MIN_REDUCE_ROWS = 16
"""On CUDA a row reduction runs over at least this many rows (zero rows padded). torch's
reduce kernel (ATen's Reduce.cuh) sizes its thread block from the number of rows while they
are fewer than 16 (one row: its lanes span the row; 16 or more: 32 lanes per row), which
would make a row's sum depend on its batch; from 16 rows on the block shape depends on the
row length alone. Read from the kernel's source, not yet measured on a GPU: bench/gpu_check.py
part (c) is the check. CPU reductions are row-invariant as they are and stay untouched."""


def mean_sq(xf: torch.Tensor, pad_rows: bool | None = None) -> torch.Tensor:
    """Mean of squares over the last dimension, keepdim, row-invariant on every device
    (`pad_rows`: pad to MIN_REDUCE_ROWS rows; default: off the CPU)."""
    if not (xf.device.type != "cpu" if pad_rows is None else pad_rows):
        return xf.pow(2).mean(-1, keepdim=True)
    rows = xf.reshape(-1, xf.shape[-1])
    n = rows.shape[0]
    if n < MIN_REDUCE_ROWS:
        rows = torch.cat([rows, rows.new_zeros(MIN_REDUCE_ROWS - n, rows.shape[1])])
    return rows.pow(2).mean(-1, keepdim=True)[:n].view(*xf.shape[:-1], 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 whatever `x`'s dtype (a no-op cast in float32), scaled by `weight` in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(mean_sq(xf) + eps)).to(x.dtype) * weight


def linear(x: torch.Tensor, w: torch.Tensor, tile: int | None) -> torch.Tensor:
    """x [N, K] @ w[out, K].T; in batch-invariant mode as a batch of fixed [tile, K] row tiles."""
    if tile is None:
        return F.linear(x, w)
    n, k = x.shape
    pad = (-n) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    nt = (n + pad) // tile
    out = torch.bmm(x.view(nt, tile, k), w.t().expand(nt, k, w.shape[0])).view(n + pad, -1)
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
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, Hkv, D]. Returns [n, H, D].
    Grouped-query heads share their key/value head inside the kernel (`enable_gqa`): no
    expanded copy of the keys and values per step (the same numbers as expanding them)."""
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    elif start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        lk = k.shape[0]
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        mask = torch.arange(lk, device=q.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


KEY_CHUNK = 64
"""Batch-invariant attention pads every query tile's keys to a multiple of this many."""


def attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, tile: int) -> torch.Tensor:
    """Batch-invariant attention. Same arguments as `attention_fast`.

    Query tile j holds positions [j*tile, (j+1)*tile) and attends to keys [0, L_j) with
    L_j = (j+1)*tile rounded up to KEY_CHUNK; keys past a row's position are masked, keys not
    yet computed (a decode step) are zero. Tiles with the same L_j run as one batched matmul
    of identical per-tile shape, so a tile's numbers do not depend on how many share the call.
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    chunk = -(-KEY_CHUNK // tile) * tile
    first, last = start // tile, (start + n - 1) // tile
    # Query tiles [first, last]: rows are absolute positions; rows outside this call stay zero.
    ntiles = last - first + 1
    qt = q.new_zeros(ntiles * tile, h, d)
    qt[start - first * tile : start - first * tile + n] = q * d ** -0.5
    qt = qt.view(ntiles, tile, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(ntiles, hkv, g * tile, d)
    have = k.shape[0]
    outs = []
    j = first
    while j <= last:
        lk = -(-((j + 1) * tile) // chunk) * chunk
        j_end = min(last, lk // tile - 1)  # tiles j..j_end share key length lk
        nt = j_end - j + 1
        kt, vt = k[:lk], v[:lk]
        if have < lk:
            kt = torch.cat([kt, k.new_zeros(lk - have, hkv, d)])
            vt = torch.cat([vt, v.new_zeros(lk - have, hkv, d)])
        qpos = torch.arange(j * tile, (j_end + 1) * tile, device=q.device).view(nt, 1, tile, 1)
        masked = torch.arange(lk, device=q.device) > qpos
        heads = []
        for hk in range(hkv):
            # A stride-0 batch of this head's keys: every tile is its own same-shape matmul.
            kh = kt[:, hk].t().expand(nt, d, lk)
            scores = torch.bmm(qt[j - first : j_end - first + 1, hk], kh).view(nt, g, tile, lk)
            probs = torch.softmax(scores.float().masked_fill(masked, float("-inf")), dim=-1).to(q.dtype)
            heads.append(torch.bmm(probs.view(nt, g * tile, lk), vt[:, hk].expand(nt, lk, d)))
        o = torch.stack(heads, 1).view(nt, hkv, g, tile, d).permute(0, 3, 1, 2, 4).reshape(nt * tile, h, d)
        outs.append(o)
        j = j_end + 1
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    off = start - first * tile
    return out[off : off + n]


def probe_row_invariance(k: int = 256, n: int = 512, tile: int = 4, trials: int = 8,
                         device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                         tile_counts: tuple[int, ...] = ()) -> bool:
    """True when a row of a batched [tile, k] matmul depends neither on the other rows of its
    tile, nor on its place in the tile, nor on how many tiles share the call (1, 4, 7, ...
    tiles over `trials`, then each of `tile_counts`: a GPU library picks kernels by shape, so
    a GPU engine probes its own matmul shapes at the batch sizes it will run).
    Random data is drawn on the host and moved, so every device probes the same numbers."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
    x0 = torch.randn(k, generator=g).to(device=device, dtype=dtype)
    ref = linear(x0.expand(tile, k).contiguous(), w, tile)[0]
    counts = [1 + 3 * t for t in range(trials)] + list(tile_counts)
    for t, c in enumerate(counts):
        rows = tile * c
        xt = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
        at = (t * 5) % rows
        xt[at] = x0
        if not torch.equal(linear(xt, w, tile)[at], ref):
            return False
    return True


def probe_tiles(spec, cfg, device: torch.device, dtype: torch.dtype) -> bool:
    """The engine's start-up probe. On CPU the one small probe it always ran; elsewhere each of
    the model's own matmul shapes (k, n), at tile counts up to a large mixed batch."""
    if device.type == "cpu":
        return probe_row_invariance(tile=cfg.row_tile, dtype=dtype)
    d, hd = spec.hidden_size, spec.head_dim
    shapes = {(d, (spec.num_heads + 2 * spec.num_kv_heads) * hd), (spec.num_heads * hd, d),
              (d, 2 * spec.intermediate_size), (spec.intermediate_size, d)}
    counts = (16, 64, 128, 256, 1024)
    out_rows = len(spec.output_ids() or range(spec.vocab_size))
    g = spec.num_heads // spec.num_kv_heads
    attn = [(g * cfg.row_tile, hd, lk) for lk in (64, 1024)] + [(g * cfg.row_tile, lk, hd) for lk in (64, 1024)]
    return (all(probe_row_invariance(k, n, cfg.row_tile, 4, device, dtype, counts) for k, n in sorted(shapes))
            and probe_row_invariance(d, out_rows, cfg.row_tile, 4, device, dtype, (16, 64, 256))
            and all(probe_bmm_batch(m, k, n, (2, 7, 64, 256), device, dtype) for m, k, n in attn))


def probe_bmm_batch(m: int, k: int, n: int, counts: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> bool:
    """True when each matrix of a batched [m, k] @ [k, n] product does not depend on how many
    share the call (the attention tiles' matmuls, whose batch is the number of query tiles)."""
    g = torch.Generator().manual_seed(4321)
    for c in counts:
        a = torch.randn(c, m, k, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(c, k, n, generator=g).to(device=device, dtype=dtype)
        whole = torch.bmm(a, b)
        j = (c * 5) // 7
        if not torch.equal(whole[j], torch.bmm(a[j : j + 1], b[j : j + 1])[0]):
            return False
    return True

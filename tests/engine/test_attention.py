"""Fast-mode attention against a plain reference: grouped-query heads expanded into copies and
a softmax over masked scores, for a decode step, a first prefill chunk and a later one."""

from __future__ import annotations

import pytest
import torch

from cells.engine.embedded.layers import attention_fast


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    n, h, d = q.shape
    g = h // k.shape[1]
    kx, vx = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, H, D]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kx.double()) / d ** 0.5
    pos = torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vx.double()).float()


@pytest.mark.parametrize("n,start", [(1, 0), (1, 777), (33, 0), (17, 40)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 8), (8, 1)])
def test_fast_attention_matches_the_expanded_reference(n, start, heads, kv_heads):
    torch.manual_seed(n * 1000 + start)
    q = torch.randn(n, heads, 16)
    k, v = torch.randn(start + n, kv_heads, 16), torch.randn(start + n, kv_heads, 16)
    out = attention_fast(q, k, v, start)
    assert out.shape == (n, heads, 16)
    torch.testing.assert_close(out, _reference(q, k, v, start), rtol=1e-5, atol=1e-5)

"""Chunked log-probs (cells/engine/embedded/logprob_chunks.py): the same log-probs and gradients
as the whole [T, V] log-softmax, bitwise log-probs in batch-invariant mode; per-layer
activation checkpointing gives the same gradients."""

from dataclasses import replace

import pytest
import torch

from cells.engine.embedded.logprob_chunks import chunked_target_logprobs
from cells.engine.embedded.model import (
    Segment,
    forward,
    init_weights,
    output_logprobs,
    prepare,
    token_logprobs,
)
from cells.engine.embedded.model_spec import PRESETS

SPEC = replace(PRESETS["toy"], vocab_size=3000, output_id_ranges=None, max_position=256)


def _close(a, b, tol=1e-5):
    """Equal up to the float order of the sums: ||a - b|| <= tol * ||a||."""
    return float((a - b).norm()) <= tol * float(a.norm())


def _whole(prep, ids, tile):
    """The reference: the [T, V] log-softmax, then the targets."""
    hidden = forward(prep, ids, torch.arange(len(ids)), [Segment(0, len(ids), 0)], tile)
    return output_logprobs(prep, hidden[:-1], 0.7, tile).gather(1, ids[1:, None])[:, 0]


def _grads(fn, weights):
    w = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    lp = fn(w)
    g = torch.linspace(-1.0, 1.0, lp.shape[0])  # a non-uniform upstream gradient
    (lp * g).sum().backward()
    return lp.detach(), {k: v.grad for k, v in w.items()}


@pytest.mark.parametrize("tile", [None, 4])
def test_chunked_logprobs_and_gradients_equal_whole(tile):
    weights = init_weights(SPEC, seed=3, std=0.1)
    ids = torch.randint(0, SPEC.vocab_size, (70,), generator=torch.Generator().manual_seed(0))

    def chunked(w, checkpoint=False):
        import cells.engine.embedded.logprob_chunks as lc
        old, lc.CHUNK_BYTES = lc.CHUNK_BYTES, 8 * 4 * SPEC.vocab_size  # 8 rows a chunk: 9 chunks
        try:
            return token_logprobs(prepare(SPEC, w, checkpoint=checkpoint), ids, 0.7, tile)
        finally:
            lc.CHUNK_BYTES = old

    lp_a, g_a = _grads(lambda w: _whole(prepare(SPEC, w), ids, tile), weights)
    lp_b, g_b = _grads(chunked, weights)
    lp_c, g_c = _grads(lambda w: chunked(w, checkpoint=True), weights)
    lp_d, g_d = _grads(lambda w: chunked(w, checkpoint="layer"), weights)
    if tile is not None:
        assert torch.equal(lp_a, lp_b)  # batch-invariant: bitwise
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    for k in weights:
        assert _close(g_a[k], g_b[k]), k
        assert _close(g_b[k], g_c[k]) and _close(g_b[k], g_d[k]), k
    assert torch.equal(lp_c, lp_b) and torch.equal(lp_d, lp_b)


def test_chunked_gradient_negative_control():
    """A wrong backward (one chunk's gradient dropped) is caught by the same comparison."""
    g = torch.Generator().manual_seed(1)
    head = torch.randn(500, 16, generator=g, requires_grad=True)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    idx = torch.randint(0, 500, (40,), generator=g)
    whole = torch.log_softmax(hidden @ head.t() / 0.7, -1).gather(1, idx[:, None])[:, 0]
    ga = torch.autograd.grad(whole.sum(), (hidden, head))
    lp = chunked_target_logprobs(head, hidden, idx, 0.7, None, rows=7)
    gb = torch.autograd.grad(lp.sum(), (hidden, head))
    torch.testing.assert_close(lp, whole, rtol=1e-5, atol=1e-5)
    assert all(_close(a, b) for a, b in zip(ga, gb))
    mask = torch.ones(40)
    mask[7:14] = 0.0  # the second chunk's rows contribute nothing
    gc = torch.autograd.grad((chunked_target_logprobs(head, hidden, idx, 0.7, None, rows=7) * mask).sum(),
                             (hidden, head))
    assert not _close(ga[0], gc[0]) and not _close(ga[1], gc[1])

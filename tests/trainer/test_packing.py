"""Several sequences per forward (cells/rl/packing.py): packed without padding, the log-probs,
entropies and gradients of each sequence's own forward (bitwise log-probs in batch-invariant
mode)."""

from dataclasses import replace

import pytest
import torch

from cells.engine.embedded.model import init_weights, prepare
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.packing import sequence_logprobs

SPEC = replace(PRESETS["toy"], vocab_size=600, output_id_ranges=((0, 300),), max_position=128)


def _run(pack, tile, seqs):
    w = {k: v.clone().requires_grad_(True) for k, v in init_weights(SPEC, 1, 0.1).items()}
    ent: list = []
    lps = sequence_logprobs(prepare(SPEC, w), seqs, 0.8, tile, ent, pack)
    sum((lp * torch.linspace(0.5, 1.5, lp.shape[0])).sum() for lp in lps).backward()
    return lps, ent, {k: v.grad for k, v in w.items()}


@pytest.mark.parametrize("tile", [None, 4])
def test_packed_equals_one_forward_per_sequence(tile):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (13, 1, 29, 7, 40)]
    a_lp, a_ent, a_g = _run(False, tile, seqs)
    b_lp, b_ent, b_g = _run(True, tile, seqs)
    assert [x.shape for x in a_lp] == [x.shape for x in b_lp]
    for x, y in zip(a_lp + a_ent, b_lp + b_ent):
        if tile is not None:
            assert torch.equal(x.detach(), y.detach())
        torch.testing.assert_close(y.detach(), x.detach(), rtol=1e-5, atol=1e-5)
    for k in a_g:
        assert float((a_g[k] - b_g[k]).norm()) <= 1e-5 * float(a_g[k].norm())
    # negative control: two sequences swapped is a different batch
    c_lp, _, _ = _run(True, tile, [seqs[0], seqs[1], seqs[3], seqs[2], seqs[4]])
    assert not torch.equal(c_lp[2].detach()[:7], a_lp[2].detach()[:7])

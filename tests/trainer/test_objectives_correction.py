"""Each correction mode on hand-picked numbers, the catastrophic reject and self-normalisation."""

import math

import pytest
import torch

from cells.rl.objectives.config import (
    MISSequenceCorrection,
    MISTokenCorrection,
    NoCorrection,
    TISSequenceCorrection,
    TISTokenCorrection,
)
from cells.rl.objectives.correction import apply_correction

torch.set_num_threads(1)

NAN = float("nan")


def _log_rho(rows):
    return torch.tensor(
        [[math.log(x) if x == x else NAN for x in r] for r in rows], dtype=torch.float64
    )


# seq 0: rho = 1.5, 3, 0.25 (product 1.125, geometric mean 1.04)
# seq 1: rho = 1, 0.6, <masked, NaN> (product 0.6, geometric mean 0.775)
LOG_RHO = _log_rho([[1.5, 3.0, 0.25], [1.0, 0.6, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _check(corr, weight, keep):
    torch.testing.assert_close(corr.weight, torch.tensor(weight, dtype=torch.float64))
    assert corr.keep.tolist() == keep


def test_none_gives_unit_weight():
    corr = apply_correction(LOG_RHO, MASK, NoCorrection())
    _check(corr, [[1, 1, 1], [1, 1, 0]], [[True] * 3, [True, True, False]])


def test_tis_token():
    corr = apply_correction(LOG_RHO, MASK, TISTokenCorrection(cap=2.0))
    _check(corr, [[1.5, 2.0, 0.25], [1.0, 0.6, 0.0]], [[True] * 3, [True, True, False]])


def test_tis_sequence():
    corr = apply_correction(LOG_RHO, MASK, TISSequenceCorrection(cap=2.0))
    _check(corr, [[1.125] * 3, [0.6, 0.6, 0.0]], [[True] * 3, [True, True, False]])
    capped = apply_correction(LOG_RHO, MASK, TISSequenceCorrection(cap=1.1))
    _check(capped, [[1.1] * 3, [0.6, 0.6, 0.0]], [[True] * 3, [True, True, False]])


def test_mis_token_icepop():
    corr = apply_correction(LOG_RHO, MASK, MISTokenCorrection(low=0.5, high=2.0))
    _check(corr, [[1.5, 0.0, 0.0], [1.0, 0.6, 0.0]], [[True, False, False], [True, True, False]])
    wide = apply_correction(LOG_RHO, MASK, MISTokenCorrection(low=0.2, high=5.0))
    _check(wide, [[1.5, 3.0, 0.25], [1.0, 0.6, 0.0]], [[True] * 3, [True, True, False]])


def test_mis_sequence_product_and_geometric_mean():
    prod = apply_correction(LOG_RHO, MASK, MISSequenceCorrection(low=0.7, high=1.1))
    _check(prod, [[0.0] * 3, [0.0] * 3], [[False] * 3, [False] * 3])  # 1.125 > 1.1, 0.6 < 0.7
    geo = apply_correction(
        LOG_RHO, MASK, MISSequenceCorrection(low=0.7, high=1.1, statistic="geometric_mean")
    )
    g0, g1 = 1.125 ** (1 / 3), 0.6**0.5
    _check(geo, [[g0] * 3, [g1, g1, 0.0]], [[True] * 3, [True, True, False]])
    one = apply_correction(LOG_RHO, MASK, MISSequenceCorrection(low=0.5, high=1.0))
    _check(one, [[0.0] * 3, [0.6, 0.6, 0.0]], [[False] * 3, [True, True, False]])


@pytest.mark.parametrize(
    "mode",
    [
        NoCorrection(),
        TISTokenCorrection(),
        TISSequenceCorrection(),
        MISTokenCorrection(low=1e-6, high=1e6),
        MISSequenceCorrection(low=1e-9, high=1e9),
    ],
)
def test_catastrophic_reject_drops_the_whole_sequence(mode):
    log_rho = _log_rho([[1.5, 1.0, 0.9], [1.0, 5e-5, 1.0]])
    corr = apply_correction(log_rho, torch.ones(2, 3), mode, reject_below=1e-4)
    assert corr.keep.tolist() == [[True] * 3, [False] * 3]
    assert corr.rejected.tolist() == [False, True]
    assert corr.weight[1].abs().sum() == 0
    kept = apply_correction(log_rho, torch.ones(2, 3), mode, reject_below=None)
    assert kept.keep[1].any()


def test_reject_ignores_tokens_outside_the_mask():
    log_rho = _log_rho([[1.0, 1e-9]])
    assert apply_correction(log_rho, torch.tensor([[1, 0]]), NoCorrection()).keep.tolist() == [
        [True, False]
    ]


def test_rho_is_clamped_before_exponentiation():
    log_rho = torch.tensor([[1000.0, 0.0], [-1000.0, 0.0]], dtype=torch.float64)
    corr = apply_correction(
        log_rho, torch.ones(2, 2), MISTokenCorrection(low=1e-12, high=1e12), reject_below=None
    )
    torch.testing.assert_close(
        corr.rho[:, 0], torch.tensor([math.exp(20), math.exp(-20)], dtype=torch.float64)
    )
    assert torch.isfinite(corr.weight).all()
    seq = apply_correction(
        log_rho, torch.ones(2, 2), TISSequenceCorrection(cap=2.0), reject_below=None
    )
    torch.testing.assert_close(seq.weight[0], torch.tensor([2.0, 2.0], dtype=torch.float64))


def test_self_normalisation_divides_by_the_kept_mean():
    corr = apply_correction(LOG_RHO, MASK, TISTokenCorrection(cap=2.0), self_normalize=True)
    mean = (1.5 + 2.0 + 0.25 + 1.0 + 0.6) / 5
    expected = torch.tensor([[1.5, 2.0, 0.25], [1.0, 0.6, 0.0]], dtype=torch.float64) / mean
    torch.testing.assert_close(corr.weight, expected)
    assert corr.weight[corr.keep].mean().item() == pytest.approx(1.0)
    glob = apply_correction(
        LOG_RHO, MASK, TISTokenCorrection(cap=2.0), self_normalize=True, normalizer=2.0
    )
    torch.testing.assert_close(glob.weight, expected * mean / 2.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape mismatch"):
        apply_correction(LOG_RHO, torch.ones(2, 4), NoCorrection())
    with pytest.raises(ValueError, match="2-D"):
        apply_correction(torch.zeros(3), torch.ones(3), NoCorrection())
    with pytest.raises(ValueError, match="only 0 and 1"):
        apply_correction(LOG_RHO, torch.full((2, 3), 2), NoCorrection())

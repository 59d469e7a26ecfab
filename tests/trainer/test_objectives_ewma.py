"""PPO-EWMA: the recurrence by hand, its unrolled closed form, beta from the window, auto-reset."""

import pytest
import torch

from cells.rl.objectives.config import (
    EWMAConfig,
    MISTokenCorrection,
    ObjectiveConfig,
    TISTokenCorrection,
)
from cells.rl.objectives.ewma import PPOEWMA, beta_for_window
from cells.rl.objectives.ppo import decoupled_ppo_loss

torch.set_num_threads(1)

F64 = torch.float64


def test_beta_from_staleness_window():
    assert beta_for_window(1) == pytest.approx(0.5)
    assert beta_for_window(4) == pytest.approx(0.8)
    assert beta_for_window(0) == 0.0
    b = beta_for_window(7)
    assert b / (1 - b) == pytest.approx(7)  # mean age of the average = the window
    with pytest.raises(ValueError):
        beta_for_window(-1)


def test_recurrence_by_hand():
    ewma = PPOEWMA({"w": torch.tensor([0.0])}, staleness_window=1)  # beta = 0.5
    ewma.update({"w": torch.tensor([4.0])})
    # W' = 0.5·1 + 1 = 1.5; theta = (0.5/1.5)·0 + (1/1.5)·4
    assert ewma.weight == pytest.approx(1.5)
    assert ewma.params["w"].item() == pytest.approx(8 / 3)
    ewma.update({"w": torch.tensor([1.0])})
    # W' = 0.75 + 1 = 1.75; theta = (0.75/1.75)·8/3 + 1/1.75 = 3/1.75
    assert ewma.weight == pytest.approx(1.75)
    assert ewma.params["w"].item() == pytest.approx(3 / 1.75)


def test_unrolled_closed_form():
    g = torch.Generator().manual_seed(5)
    thetas = [
        {
            "a": torch.randn(3, 2, generator=g, dtype=F64),
            "b": torch.randn(4, generator=g, dtype=F64),
        }
        for _ in range(7)
    ]
    ewma = PPOEWMA(thetas[0], staleness_window=3, dtype=F64)
    for th in thetas[1:]:
        ewma.update(th)
    beta = 0.75
    k = len(thetas) - 1
    coef = [beta ** (k - i) for i in range(k + 1)]  # theta_i weighted by beta^(k−i)
    assert ewma.weight == pytest.approx(sum(coef))
    for name in ("a", "b"):
        expected = sum(c * th[name] for c, th in zip(coef, thetas, strict=True)) / sum(coef)
        torch.testing.assert_close(ewma.params[name], expected)


def test_copies_to_host_float32_and_keeps_integer_buffers():
    src = {"w": torch.ones(2, dtype=F64), "steps": torch.tensor([3])}
    ewma = PPOEWMA(src, staleness_window=2)
    assert ewma.params["w"].dtype == torch.float32 and ewma.params["w"].device.type == "cpu"
    src["w"] += 1  # the average holds a copy
    assert ewma.params["w"].tolist() == [1.0, 1.0]
    ewma.update({"w": torch.zeros(2), "steps": torch.tensor([4])})
    assert ewma.params["steps"].tolist() == [4]
    with pytest.raises(ValueError, match="missing"):
        ewma.update({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        ewma.update({"w": torch.zeros(3), "steps": torch.tensor([4])})


def test_auto_reset_below_tau():
    ewma = PPOEWMA({"w": torch.tensor([0.0])}, staleness_window=4, reset_threshold=0.5)
    ewma.update({"w": torch.tensor([10.0])})
    assert not ewma.maybe_reset({"w": torch.tensor([10.0])}, num_missing_in_band=6, num_missing=10)
    assert not ewma.maybe_reset({"w": torch.tensor([10.0])}, num_missing_in_band=0, num_missing=0)
    assert ewma.weight != 1.0
    assert ewma.maybe_reset({"w": torch.tensor([10.0])}, num_missing_in_band=4, num_missing=10)
    assert ewma.weight == 1.0 and ewma.params["w"].item() == 10.0 and ewma.num_resets == 1


def test_reset_driven_by_the_loss_metrics():
    # the stand-in policy drifted: 3 of 4 missing tokens fall outside the MIS bounds
    lp = torch.zeros(1, 4, dtype=F64)
    lp_stand = torch.tensor([[0.0, 2.0, -2.0, 3.0]], dtype=F64)
    cfg = ObjectiveConfig(correction=MISTokenCorrection(low=0.5, high=2.0))
    _, m = decoupled_ppo_loss(
        lp,
        lp,
        lp,
        torch.ones(1, dtype=F64),
        torch.ones(1, 4),
        cfg,
        provenance=torch.ones(1, 4, dtype=torch.bool),
        lp_stand=lp_stand,
    )
    ewma = PPOEWMA({"w": torch.tensor([0.0])}, staleness_window=4, reset_threshold=0.5)
    ewma.update({"w": torch.tensor([1.0])})
    assert ewma.maybe_reset({"w": torch.tensor([1.0])}, m["num_missing_in_band"], m["num_missing"])
    assert m["frac_missing_kept"] == pytest.approx(0.25)
    assert m["frac_missing_in_band"] == pytest.approx(0.25)  # the band follows the MIS bounds


def _drifted_missing_tokens(cfg):
    # the stand-in drifted: exp(lp_stand − lp_behav) = 1, e^2, e^-2, e^3 on four missing tokens
    lp = torch.zeros(1, 4, dtype=F64)
    lp_stand = torch.tensor([[0.0, 2.0, -2.0, 3.0]], dtype=F64)
    _, m = decoupled_ppo_loss(lp, lp, lp, torch.ones(1, dtype=F64), torch.ones(1, 4), cfg,
                              provenance=torch.ones(1, 4, dtype=torch.bool), lp_stand=lp_stand)
    return m


def test_reset_fires_under_token_tis():
    # token TIS keeps every token in the mask; the reset rule reads the band instead
    m = _drifted_missing_tokens(ObjectiveConfig(correction=TISTokenCorrection(cap=2.0)))
    assert m["frac_missing_kept"] == 1.0
    assert m["num_missing_in_band"] == 1 and m["num_missing"] == 4
    ewma = PPOEWMA({"w": torch.tensor([0.0])}, staleness_window=4, reset_threshold=0.5)
    ewma.update({"w": torch.tensor([1.0])})
    assert ewma.maybe_reset({"w": torch.tensor([1.0])}, m["num_missing_in_band"], m["num_missing"])
    assert ewma.num_resets == 1 and ewma.weight == 1.0


def test_reset_band_is_configurable_and_checked():
    wide = ObjectiveConfig(ewma=EWMAConfig(band=(0.01, 100.0)))
    assert wide.ewma_band() == (0.01, 100.0)
    assert _drifted_missing_tokens(wide)["num_missing_in_band"] == 4
    assert ObjectiveConfig().ewma_band() == (0.5, 2.0)
    assert ObjectiveConfig(correction=MISTokenCorrection(low=0.2, high=5.0)).ewma_band() == (0.2, 5.0)
    with pytest.raises(ValueError, match="band"):
        EWMAConfig(band=(2.0, 1.0))


def test_state_dict_round_trip():
    ewma = PPOEWMA({"w": torch.tensor([1.0, 2.0])}, staleness_window=2)
    ewma.update({"w": torch.tensor([3.0, 5.0])})
    other = PPOEWMA({"w": torch.zeros(2)}, staleness_window=2)
    other.load_state_dict(ewma.state_dict())
    assert other.weight == pytest.approx(ewma.weight)
    torch.testing.assert_close(other.params["w"], ewma.params["w"])
    with pytest.raises(ValueError, match="__ewma_weight__"):
        other.load_state_dict({"w": torch.zeros(2)})


def test_a_row_restricted_update_folds_in_those_rows_only():
    w0 = torch.randn(6, 4)
    theta = w0.clone()
    theta[[1, 4]] += 1.0  # the rows a step moved
    dense = PPOEWMA({"w": w0, "b": torch.zeros(3)}, staleness_window=4)
    rows = PPOEWMA({"w": w0, "b": torch.zeros(3)}, staleness_window=4)
    dense.update({"w": theta, "b": torch.ones(3)})
    rows.update({"w": theta, "b": torch.ones(3)}, rows={"w": torch.tensor([1, 4])})
    assert rows.weight == dense.weight
    assert torch.allclose(rows.params["w"][[1, 4]], dense.params["w"][[1, 4]], rtol=0, atol=1e-6)
    assert not torch.equal(rows.params["w"][1], w0[1])
    assert torch.equal(rows.params["w"][[0, 2, 3, 5]], w0[[0, 2, 3, 5]])  # untouched, bitwise
    assert torch.equal(rows.params["b"], dense.params["b"])  # tensors not named: all of it

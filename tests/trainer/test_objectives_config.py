"""The objective's config: variants by `type`, unknown keys and bad values rejected, docs on every field."""

import pytest
from pydantic import BaseModel, ValidationError

from cells.rl.objectives import config as C

MODELS = [
    C.NoCorrection,
    C.TISTokenCorrection,
    C.TISSequenceCorrection,
    C.MISTokenCorrection,
    C.MISSequenceCorrection,
    C.KLInReward,
    C.KLInLoss,
    C.GRPOAdvantage,
    C.RLOOAdvantage,
    C.EWMAConfig,
    C.TreeConfig,
    C.ObjectiveConfig,
]


def test_defaults():
    cfg = C.ObjectiveConfig()
    assert isinstance(cfg.correction, C.TISTokenCorrection) and cfg.correction.cap == 2.0
    assert cfg.reject_below == 1e-4 and cfg.kl is None and cfg.tree.max_branches == 5
    assert C.MISTokenCorrection().low == 0.5 and C.MISTokenCorrection().high == 2.0


def test_discriminated_unions_select_variants():
    cfg = C.ObjectiveConfig.model_validate(
        {
            "correction": {
                "type": "mis_sequence",
                "low": 0.8,
                "high": 1.25,
                "statistic": "geometric_mean",
            },
            "kl": {"type": "loss", "coef": 0.01},
            "advantage": {"type": "rloo"},
        }
    )
    assert isinstance(cfg.correction, C.MISSequenceCorrection)
    assert isinstance(cfg.kl, C.KLInLoss) and cfg.kl.estimator == "k3"
    assert isinstance(cfg.advantage, C.RLOOAdvantage)
    with pytest.raises(ValidationError, match="tis_token"):  # the error lists the valid tags
        C.ObjectiveConfig.model_validate({"correction": {"type": "tis_tokens"}})


@pytest.mark.parametrize(
    "bad",
    [
        {"correction": {"type": "tis_token", "low": 0.5}},  # field of another variant
        {"clip": 0.2},
        {"correction": {"type": "mis_token", "low": 2.0, "high": 0.5}},
        {"dual_clip": 1.0},
        {"clip_low": 1.0},
        {"tree": {"max_branches": 6}},
        {"ewma": {"reset_threshold": 1.5}},
    ],
)
def test_bad_values_rejected(bad):
    with pytest.raises(ValidationError):
        C.ObjectiveConfig.model_validate(bad)


def test_every_field_has_a_docstring():
    for model in MODELS:
        assert issubclass(model, BaseModel)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"

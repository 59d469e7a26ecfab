"""The GPU cluster example config and the engine selector."""

from __future__ import annotations

from pathlib import Path

import fake_sglang
import pytest

from cells.engine.sglang.engine import SGLangEngine
from scheduler.contract.config import ConfigError, load_config, parse_config
from scheduler.contract.config.engine import SGLangEngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_cluster_example_loads_and_builds_a_cell():
    cfg = load_config(ROOT / "configs" / "gpu_cluster.yaml")
    eng_cfg = cfg.cells.engine
    assert isinstance(eng_cfg, SGLangEngineConfig) and eng_cfg.type == "sglang" and eng_cfg.tp == 8
    mods, _ = fake_sglang.fake_modules()
    eng = SGLangEngine(eng_cfg, modules=mods)
    assert not eng.capabilities.scoring and eng.num_update_ranks == 8
    assert eng.runtime.sglang.server_args["tp_size"] == 8
    eng.close()


@pytest.mark.parametrize("engine,needle", [
    ({"type": "vllm"}, "sglang"),
    ({"type": "sglang", "model_path": "m", "scoring": "nowhere"}, "cell_copy"),
    ({"type": "sglang"}, "model_path"),
])
def test_engine_selector_errors_name_the_choices(engine, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"cells": {"engine": engine}})


def test_gpu_guide_covers_both_scoring_choices():
    text = (ROOT / "docs" / "GPU.md").read_text()
    assert "cell_copy" in text and "publisher_copy" in text and "0.5.23" in text


def test_gpu_cluster_example_promises_exact_reprefill_and_starts_sglang_deterministic():
    eng_cfg = load_config(ROOT / "configs" / "gpu_cluster.yaml").cells.engine
    assert eng_cfg.deterministic
    mods, _ = fake_sglang.fake_modules()
    eng = SGLangEngine(eng_cfg, modules=mods)
    assert eng.runtime.sglang.server_args["enable_deterministic_inference"] is True and eng.capabilities.batch_invariant
    eng.close()

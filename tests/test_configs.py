from pathlib import Path

import pytest

from scheduler.contract.config import ConfigError, load_config, parse_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# configs/sim/ holds cluster-simulator workloads, configs/jobs/ `cellflip up --rl-jobs` files:
# other schemas, with their own tests.
CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.relative_to(CONFIG_DIR).parts[0] not in ("sim", "jobs"))
JOBS_FILES = sorted((CONFIG_DIR / "jobs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "local.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path):
    load_config(path)


@pytest.mark.parametrize("path", JOBS_FILES, ids=lambda p: p.name)
def test_every_jobs_file_loads(path):
    from cells.rl_jobs import load_jobs_file

    assert load_jobs_file(path).jobs


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"cells\.engine\.embedded\.num_blockz"):
        parse_config({"cells": {"engine": {"type": "embedded", "num_blockz": 3}}})


def test_bad_value_is_named_with_its_value():
    with pytest.raises(ConfigError, match=r"scheduler\.lease_s = -1"):
        parse_config({"scheduler": {"lease_s": -1}})


def test_engine_type_lists_valid_choices():
    with pytest.raises(ConfigError, match="embedded.*sglang|sglang.*embedded"):
        parse_config({"cells": {"engine": {"type": "vllm"}}})


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: [1, 2")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)

"""`cellflip up --rl-jobs FILE`: the file checked whole (bad input: one clear error naming the
job and key, nothing started), and what each job's trainer runs with."""

from __future__ import annotations

from pathlib import Path

import pytest

from cells.rl_jobs import (
    VERSION_STRIDE,
    JobsFileError,
    check_fits,
    load_jobs_file,
    parse_jobs,
    trainer_config,
)
from scheduler.contract.config import parse_config

GOOD = {"warmup": {"steps": 10, "seed": 3}, "jobs": [
    {"name": "a", "seed": 1, "min_cells": 2, "trainer": {"steps": 4, "lr": 0.002}},
    {"name": "b", "seed": 2, "task": {"p_pair": 0.6, "codes": ["lime", "plum"]}, "settings": {"max_sessions": 9}}]}


def test_a_good_file_and_each_jobs_trainer_config(tmp_path):
    jobs = parse_jobs(GOOD)
    assert (jobs.warmup_steps, jobs.warmup_seed, [j.name for j in jobs.jobs]) == (10, 3, ["a", "b"])
    body = jobs.jobs[1].create_body("/warm")
    assert body["settings"] == {"max_sessions": 9, "seed": 2, "task": {"p_pair": 0.6, "codes": ["lime", "plum"]}}
    raw = {"trainer": {"steps": 20, "train_cells": 2}}
    a, b = (parse_config(trainer_config(raw, j, i, tmp_path)).trainer for i, j in enumerate(jobs.jobs))
    assert (a.steps, a.lr, a.seed, a.first_version, a.warmup_steps, a.train_cells) == (4, 0.002, 1, 1, 0, 1)
    assert (b.steps, b.seed, b.first_version, b.task["p_pair"]) == (20, 2, VERSION_STRIDE + 1, 0.6)
    assert a.export_dir != b.export_dir and a.checkpoint_dir != b.checkpoint_dir
    assert raw == {"trainer": {"steps": 20, "train_cells": 2}}  # the fleet's config is left alone
    check_fits(jobs, 4)
    with pytest.raises(JobsFileError, match="need 4 cells"):
        check_fits(jobs, 3)


@pytest.mark.parametrize("raw, match", [
    ({}, "non-empty list `jobs:`"),
    ({"jobs": []}, "non-empty list"),
    ({"jobs": [{"name": "a"}], "extra": 1}, r"unknown top-level keys \['extra'\]"),
    ({"jobs": [{"name": "A"}]}, r"jobs\[0\]: name 'A'"),
    ({"jobs": [{"name": "default"}]}, "not `default`"),
    ({"jobs": [{"name": "a"}, {"name": "a"}]}, r"repeated: \['a'\]"),
    ({"jobs": [{"name": "a", "colour": 1}]}, r"unknown keys \['colour'\]"),
    ({"jobs": [{"name": "a", "seed": "x"}]}, r"\(a\): seed must be an integer"),
    ({"jobs": [{"name": "a", "min_cells": 3, "max_cells": 2}]}, "max_cells one >= max"),
    ({"jobs": [{"name": "a", "weight": 0}]}, "weight must be a number > 0"),
    ({"jobs": [{"name": "a", "task": {"p_pair": 2}}]}, r"bad task variant .*p_pair must lie in \[0, 1\]"),
    ({"jobs": [{"name": "a", "task": {"colour": 1}}]}, "bad task variant"),
    ({"jobs": [{"name": "a", "task": {"seed": 1}}]}, "the task's seed is the job's `seed`"),
    ({"jobs": [{"name": "a", "settings": {"seed": 1}}]}, r"unknown settings \['seed'\]"),
    ({"jobs": [{"name": "a", "trainer": {"seed": 1}}]}, r"trainer settings \['seed'\] are set from the job"),
    ({"jobs": [{"name": "a", "trainer": {"lr": -1}}]}, r"bad trainer settings: \('lr',\)"),
    ({"jobs": [{"name": "a"}], "warmup": {"steps": -1}}, "warmup.steps must be an integer >= 0"),
])
def test_bad_input_is_one_clear_error(raw, match):
    with pytest.raises(JobsFileError, match=match):
        parse_jobs(raw)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(JobsFileError, match="cannot read"):
        load_jobs_file(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("jobs: [1, 2")
    with pytest.raises(JobsFileError, match="not YAML"):
        load_jobs_file(bad)
    shipped = Path(__file__).resolve().parents[2] / "configs" / "jobs" / "rl_jobs.yaml"
    assert len(load_jobs_file(shipped).jobs) == 2

"""`cellflip up --rl-jobs FILE`: the jobs file (several toy RL jobs on one fleet), checked whole
before anything starts, and what each job's trainer runs with.

    warmup: {steps: 300, seed: 0}      # the supervised warm-up, run once; every job starts from it
    jobs:
      - name: lookup-a                 # the job's name (the OpenAI `model` its agents send)
        seed: 1                        # its task stream and sampling seeds
        task: {p_pair: 0.3}            # its toy task variant (TaskSpec fields but the seed)
        min_cells: 2                   # the fleet division (docs/JOBS.md)
        max_cells: 3
        weight: 1.0
        settings: {}                   # job settings (staleness_bound, staleness_policy, min_rollout_cells, ...)
        trainer: {steps: 10, lr: 1e-3} # its trainer's settings over the config's `trainer`

Each job's trainer gets its own version range (`trainer.first_version`: version ids are one
space across the fleet's jobs), its own export and checkpoint directories, and no warm-up of its
own (`warmup_steps` 0: it starts from the shared warmed checkpoint).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOB_KEYS = ("name", "seed", "task", "min_cells", "max_cells", "weight", "settings", "trainer")
SETTINGS_KEYS = ("objective", "staleness_bound", "staleness_policy", "min_rollout_cells", "max_sessions", "drain_s")
"""Job settings the file may give (`seed` and `task` are the job's own keys)."""
RESERVED_TRAINER = ("enabled", "seed", "task", "first_version", "warmup_steps", "export_dir")
"""Trainer settings each job's trainer gets from the job, never from its `trainer` block."""
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")  # the scheduler's rule (scheduler/control/jobs.py)
VERSION_STRIDE = 1_000_000
"""Job i (from 0, in the file's order) publishes versions i x VERSION_STRIDE + 1, + 2, ..."""


class JobsFileError(ValueError):
    """A jobs file that cannot run, with where and why (nothing was started)."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    seed: int
    task: dict[str, Any] = field(default_factory=dict)
    min_cells: int = 1
    max_cells: int | None = None
    weight: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)

    def create_body(self, model: str) -> dict[str, Any]:
        """The body of `POST /v1/jobs` for this job."""
        return {"name": self.name, "model": model, "min_cells": self.min_cells, "max_cells": self.max_cells,
                "weight": self.weight, "settings": {**self.settings, "seed": self.seed, "task": self.task}}


@dataclass(frozen=True)
class JobsFile:
    jobs: list[JobSpec]
    warmup_steps: int = 300
    warmup_seed: int = 0


def load_jobs_file(path: str | Path) -> JobsFile:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise JobsFileError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise JobsFileError(f"{path}: not YAML: {e}") from None
    return parse_jobs(raw, str(path))


def parse_jobs(raw: Any, where: str = "jobs file") -> JobsFile:
    """The jobs file checked whole: every error names the job and the key."""
    if not isinstance(raw, dict) or not isinstance(raw.get("jobs"), list) or not raw["jobs"]:
        raise JobsFileError(f"{where}: needs a non-empty list `jobs:` (see configs/jobs/rl_jobs.yaml)")
    unknown = sorted(set(raw) - {"jobs", "warmup"})
    if unknown:
        raise JobsFileError(f"{where}: unknown top-level keys {unknown} (known: jobs, warmup)")
    warm = raw.get("warmup") or {}
    if not isinstance(warm, dict) or set(warm) - {"steps", "seed"}:
        raise JobsFileError(f"{where}: `warmup` takes `steps` and `seed` only")
    steps, seed = warm.get("steps", 300), warm.get("seed", 0)
    if not _is_int(steps) or steps < 0 or not _is_int(seed):
        raise JobsFileError(f"{where}: warmup.steps must be an integer >= 0 and warmup.seed an integer")
    jobs = [_job(j, f"{where}: jobs[{i}]") for i, j in enumerate(raw["jobs"])]
    names = [j.name for j in jobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise JobsFileError(f"{where}: job names must be distinct; repeated: {dup}")
    return JobsFile(jobs, int(steps), int(seed))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _job(raw: Any, where: str) -> JobSpec:
    if not isinstance(raw, dict):
        raise JobsFileError(f"{where}: a job is a mapping with {', '.join(JOB_KEYS)}")
    bad = sorted(set(raw) - set(JOB_KEYS))
    if bad:
        raise JobsFileError(f"{where}: unknown keys {bad} (known: {', '.join(JOB_KEYS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name) or name == "default":
        raise JobsFileError(f"{where}: name {name!r} must be lower-case letters, digits, '.', '_', '-' "
                            "(at most 63, not `default`)")
    where = f"{where} ({name})"
    seed, lo, hi, weight = raw.get("seed", 0), raw.get("min_cells", 1), raw.get("max_cells"), raw.get("weight", 1.0)
    if not _is_int(seed):
        raise JobsFileError(f"{where}: seed must be an integer")
    if not _is_int(lo) or lo < 0 or (hi is not None and (not _is_int(hi) or hi < max(lo, 1))):
        raise JobsFileError(f"{where}: min_cells must be an integer >= 0 and max_cells one >= max(min_cells, 1)")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
        raise JobsFileError(f"{where}: weight must be a number > 0")
    task, settings, trainer = (_mapping(raw, k, where) for k in ("task", "settings", "trainer"))
    _check_task(task, seed, where)
    bad = sorted(set(settings) - set(SETTINGS_KEYS))
    if bad:
        raise JobsFileError(f"{where}: unknown settings {bad} (known: {', '.join(SETTINGS_KEYS)}; "
                            "seed and task are the job's own keys)")
    _check_trainer(trainer, where)
    return JobSpec(name, seed, task, lo, hi, float(weight), settings, trainer)


def _mapping(raw: dict, key: str, where: str) -> dict[str, Any]:
    val = raw.get(key) or {}
    if not isinstance(val, dict):
        raise JobsFileError(f"{where}: `{key}` must be a mapping")
    return dict(val)


def _check_task(task: dict[str, Any], seed: int, where: str) -> None:
    from cells.trainer.toy_task import TaskSpec

    if "seed" in task:
        raise JobsFileError(f"{where}: the task's seed is the job's `seed`")
    try:
        TaskSpec.variant(seed, task)
    except (TypeError, ValueError) as e:
        raise JobsFileError(f"{where}: bad task variant {task}: {e}") from None


def _check_trainer(trainer: dict[str, Any], where: str) -> None:
    from pydantic import ValidationError

    from scheduler.contract.config.trainer import TrainerConfig

    reserved = sorted(set(trainer) & set(RESERVED_TRAINER))
    if reserved:
        raise JobsFileError(f"{where}: trainer settings {reserved} are set from the job, not its `trainer` block")
    try:
        TrainerConfig(**trainer)
    except ValidationError as e:
        raise JobsFileError(f"{where}: bad trainer settings: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def check_fits(jobs: JobsFile, cells: int) -> None:
    """Every job's `min_cells`, and at least one rollout and one training cell each, fit the fleet."""
    need = sum(max(j.min_cells, 2) for j in jobs.jobs)
    if need > cells:
        raise JobsFileError(f"{len(jobs.jobs)} jobs need {need} cells (each its min_cells, at least 2: one "
                            f"rollout, one training cell); the fleet has {cells} (--cells)")


def trainer_config(raw: dict, job: JobSpec, index: int, run_dir: Path) -> dict:
    """The full config `job`'s trainer process runs with: the fleet's, its trainer block over the
    config's `trainer`, its seed, task variant, version range and directories."""
    cfg = copy.deepcopy(raw)
    t = cfg.setdefault("trainer", {})
    t.update(job.trainer)
    t.update({"enabled": True, "seed": job.seed, "task": job.task, "first_version": index * VERSION_STRIDE + 1,
              "warmup_steps": 0, "export_dir": f"jobs/{job.name}"})
    t["train_cells"] = job.trainer.get("train_cells", 1)  # its other cell keeps serving its agents
    if "checkpoint_dir" not in job.trainer:
        t["checkpoint_dir"] = str(run_dir / "jobs" / job.name / "checkpoint")
    # every commit checkpointed: a cell moved to another job takes the state it held along (it
    # follows that job's store), and the job's next step then joins from the checkpoint
    t.setdefault("checkpoint_every", 1)
    return cfg

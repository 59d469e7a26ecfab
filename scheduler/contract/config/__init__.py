"""Configuration: YAML files loaded into pydantic models, one module per section.

Every field carries a docstring; unknown keys are rejected, and a bad file fails with a
`ConfigError` that names the offending key path and value. This package imports neither
torch nor `cells`, so the control plane, the cells and the cluster simulator share it. The
root (`CellflipConfig`, `parse_config`, `load_config`) is here; the sections are `base`
(`Strict`, `ConfigError`), `engine`, `cells`, `scheduler`, `gateway`, `trainer` and `launch`.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError, model_validator

from scheduler.contract.config.base import ConfigError
from scheduler.contract.config.base import Strict as _Strict
from scheduler.contract.config.cells import CellsConfig
from scheduler.contract.config.engine import EmbeddedEngineConfig, SGLangEngineConfig
from scheduler.contract.config.gateway import GatewayConfig
from scheduler.contract.config.launch import LauncherConfig, LocalLauncherConfig
from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig, VersionsConfig
from scheduler.contract.config.trainer import TrainerConfig

SCHEDULER_CONFIG_ENV = "CELLFLIP_SCHEDULER_CONFIG"
"""A scheduler started by module path reads its whole config (JSON text) from this variable."""
SHARED_PROCESS_ENV = "CELLFLIP_SCHEDULER_SHARES_PROCESS"
"""Set to 1 by a launcher that runs the scheduler in a thread of a process doing other work:
the scheduler then leaves the process's garbage collection alone (`create_app(manage_gc=...)`)."""

__all__ = ["SCHEDULER_CONFIG_ENV", "SHARED_PROCESS_ENV", "CellflipConfig", "ConfigError", "load_config", "parse_config"]


class CellflipConfig(_Strict):
    """Top-level configuration file."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """The control plane."""
    cells: CellsConfig = CellsConfig()
    """The cells."""
    migration: MigrationConfig = MigrationConfig()
    """Live KV migration."""
    versions: VersionsConfig = VersionsConfig()
    """Weight versions and old log-prob scoring."""
    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible chat gateway (`POST /v1/chat/completions`)."""
    trainer: TrainerConfig = TrainerConfig()
    """The built-in trainer and toy task (`cellflip up`)."""
    launcher: LauncherConfig = LocalLauncherConfig()
    """Where `cellflip up` starts its processes: this machine (`local`) or a Ray cluster (`ray`)."""

    @model_validator(mode="after")
    def _check(self) -> CellflipConfig:
        eng = self.cells.engine
        if isinstance(eng, EmbeddedEngineConfig) and eng.num_blocks is not None and eng.max_running > eng.num_blocks:
            raise ValueError("cells.engine.max_running exceeds cells.engine.num_blocks")
        if isinstance(eng, SGLangEngineConfig) and eng.scoring == "cell_copy" and self.versions.update_backend == "nccl":
            # The scoring copy's rank would receive on the cell's first GPU, which SGLang's tp
            # rank 0 already holds in the same communicator: NCCL refuses two ranks on one device.
            raise ValueError("cells.engine.scoring 'cell_copy' cannot be combined with versions.update_backend "
                             "'nccl' on SGLang cells (the scoring rank and SGLang's tp rank 0 would share one GPU "
                             "in one NCCL communicator); use scoring 'publisher_copy', or update_backend 'gloo'")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        val = e.get("input")
        shown = repr(val) if not isinstance(val, dict) else "{...}"
        lines.append(f"  {loc} = {shown[:80]}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict | None, source: str = "<dict>") -> CellflipConfig:
    """Validate a mapping into a `CellflipConfig`; raise `ConfigError` naming bad keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return CellflipConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path) -> CellflipConfig:
    """Read a YAML file into a `CellflipConfig`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {p}: {e}") from None
    return parse_config(data, str(p))

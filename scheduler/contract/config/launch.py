"""The `launcher:` section: where `cellflip up` starts its processes (this machine or Ray)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from scheduler.contract.config.base import Strict as _Strict


class LocalLauncherConfig(_Strict):
    """`cellflip up` starts every process on this machine as its own child (the embedded default)."""

    type: Literal["local"] = "local"
    """Launcher selector."""


class RayLauncherConfig(_Strict):
    """`cellflip up --ray`: the scheduler, the trainer and the cells start as actors on an
    existing Ray cluster (docs/RAY.md). Needs the `ray` extra."""

    type: Literal["ray"] = "ray"
    """Launcher selector."""
    address: str = "auto"
    """Ray cluster to join: `auto` (the one this machine belongs to) or a head's `host:port`."""
    namespace: str = Field(default="cellflip", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Ray namespace of the deployment's named actors (`cellflip-scheduler`, `cellflip-cell-N`,
    `cellflip-trainer`); two deployments on one Ray cluster need two namespaces."""
    scheduler_node: str | None = None
    """Node that holds the scheduler's store (a Ray node id or a node IP): `scheduler.db_path`
    is a path on it, and the scheduler actor is pinned there so that a restarted one reopens
    the same store. None: the node `cellflip up` runs on."""
    placement: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    """Strategy of the cells' placement group (one bundle per cell)."""
    cpus_per_cell: float = Field(default=1.0, gt=0)
    """CPUs in each cell's bundle."""
    gpus_per_cell: int | None = Field(default=None, ge=0)
    """GPUs in each cell's bundle; None: the SGLang engine's `tp` (0 for the embedded engine)."""
    max_restarts: int = Field(default=3, ge=0)
    """Restarts Ray grants each actor. A restarted cell is a new incarnation: the scheduler's
    fencing decides what it may still own."""
    ready_timeout_s: float = Field(default=300.0, gt=0)
    """Bound on the placement group, the scheduler and every cell coming up."""
    py_modules: list[str] = Field(default_factory=list, max_length=64)
    """Local directories (Python packages) or `.whl` files shipped to every actor with its
    runtime environment (Ray's `py_modules`): how code of one's own, such as the module of
    `trainer.objective.loss`, reaches cells on other nodes without installing it there."""


LauncherConfig = Annotated[LocalLauncherConfig | RayLauncherConfig, Field(discriminator="type")]

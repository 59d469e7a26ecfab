"""POST /v1/trainer/report: the trainer's demand and the step it just finished; PUT
/v1/trainer/version-host: where the trainer serves its versions (the one address, besides the
live cells, a published version may name as its source).

The planner's training side comes from here: how many sessions a step consumes, how many
steps run now and how many cells one can use (the demand), and for a finished step its
duration, sessions, tokens and cells (the measured training speed). The trainer reports when
a step starts and when it ends.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from pydantic import Field, model_validator

from scheduler.api.deps import ApiRoute, Ctl
from scheduler.api.principal import current_job
from scheduler.api.schemas import _Body, errors

router = APIRouter(prefix="/v1/trainer", tags=["trainer"], route_class=ApiRoute, responses=errors(401, 403))


class UpdateFigures(_Body):
    """One RL update as the trainer measured it (the scheduler's `cellflip_training_*` metrics)."""

    update_kl: float = Field(ge=0, le=1e9)
    """KL(π_prox ‖ π_new) over the batch (the trust-region guard's estimate)."""
    grad_norm: float = Field(ge=0, le=1e12)
    clip_frac: float = Field(ge=0, le=1)
    entropy: float = Field(ge=0, le=1e6)
    """The policy's mean entropy at the sampled tokens, at the update's start (nats)."""
    rejected: bool = False
    staleness: list[Annotated[int, Field(ge=0, le=1 << 50)]] = Field(default_factory=list, max_length=1024)
    """Trained tokens by how many versions older than the update's start they were (index)."""


class TrainerReport(_Body):
    batch_size: int = Field(ge=1, le=1 << 30)
    """Sessions one training step consumes."""
    steps_in_progress: int = Field(ge=0, le=1 << 20)
    """Training steps running now."""
    max_cells_per_step: int = Field(ge=1, le=1 << 20)
    """Cells one step can use."""
    max_concurrent_steps: int = Field(default=1, ge=1, le=1 << 20)
    """Steps the trainer runs at once (one RL job: 1)."""
    untrained: int = Field(default=0, ge=0, le=1 << 30)
    """Sessions the trainer has fetched and not yet trained (its buffer and the step in hand):
    the admission rule of the staleness bound counts them with the work in flight."""
    step_s: float | None = Field(default=None, gt=0, le=1e9)
    """Duration of the step that just finished (seconds)."""
    sessions: int | None = Field(default=None, ge=1, le=1 << 30)
    """Sessions that step trained on."""
    tokens: int | None = Field(default=None, ge=0, le=1 << 50)
    """Tokens that step trained on."""
    cells: int | None = Field(default=None, ge=1, le=1 << 20)
    """Training cells that step ran on."""
    update: UpdateFigures | None = None
    """That step's update figures (metrics only)."""

    @model_validator(mode="after")
    def _whole_step(self) -> TrainerReport:
        step = (self.step_s, self.sessions, self.cells)
        if any(x is not None for x in step) and any(x is None for x in step):
            raise ValueError("a finished step needs step_s, sessions and cells together")
        return self


@router.post("/report", responses=errors(413, 422))
async def report(body: TrainerReport, ctl: Ctl) -> dict:
    if body.update is not None:
        ctl.metrics.observe_update(body.update.model_dump())
    return ctl.report_training(body.batch_size, body.steps_in_progress, body.max_cells_per_step,
                               body.max_concurrent_steps, body.step_s, body.sessions, body.tokens, body.cells,
                               untrained=body.untrained, job=current_job())


class VersionHost(_Body):
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(gt=0, lt=65536)


@router.put("/version-host", responses=errors(413, 422))
async def version_host(body: VersionHost, ctl: Ctl) -> dict:
    """Register the trainer's version host: publishes may then name it as their source."""
    return ctl.register_version_host(body.host, body.port, current_job() or "default")  # the trainer's job's

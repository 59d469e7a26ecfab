"""Which cells may serve which RL job: a cell serves a job only when it runs the job's model.

A cell reports the model it runs when it registers (`RegisterRequest.model`: its preset name or
its checkpoint / Hugging Face path, as configured), kept with its capabilities (`model`). A
job's `model` is a name of that kind, or `fleet`: the fleet's own model, the one the first cell
that registered into a `fleet` job (e.g. `default`) reported (store setting `fleet.model_name`).

    compatible   a cell that reports no model (an engine or client that does not say) serves any
                 job; a job whose model is `fleet` while no cell has told the fleet's model
                 takes any cell; else the names must be equal.

Enforced where a cell comes to serve a job: an explicit move (409 `model_mismatch` with the
reason), the planner's moves (only a cell of the destination's model is picked), the division
(a job's min and max are capped by the live cells of its model: target 0 until one registers)
and a registration into a chosen job (`cellflip cell --job`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler.contract.errors import Conflict, Invalid, NotFound

if TYPE_CHECKING:
    from scheduler.store import Store
    from scheduler.store.jobs import JobRow

FLEET = "fleet"
"""A job's `model` meaning the fleet's own model."""

FLEET_MODEL_KEY = "fleet.model_name"
"""Store setting: the model the fleet's own cells run (first told by a cell registering into a
`fleet` job)."""


def cell_model(capabilities: dict) -> str | None:
    """The model a cell reported at registration (None: it did not say)."""
    m = capabilities.get("model")
    return str(m) if m else None


def fleet_model(store: Store) -> str | None:
    raw = store.fleet.setting(FLEET_MODEL_KEY)
    return str(raw) if raw else None


def wanted(job_model: str, fleet: str | None) -> str | None:
    """The model name a job's cells must run (None: any)."""
    return fleet if job_model == FLEET else job_model


def compatible(job_model: str, model: str | None, fleet: str | None) -> bool:
    want = wanted(job_model, fleet)
    return model is None or want is None or model == want


def check(store: Store, job: JobRow, cell_id: str, capabilities: dict) -> None:
    """409 `model_mismatch` when the cell does not run `job`'s model."""
    fleet = fleet_model(store)
    model = cell_model(capabilities)
    if not compatible(job.model, model, fleet):
        raise Conflict(f"cell {cell_id} runs model {model!r}, job {job.name!r} needs {wanted(job.model, fleet)!r}"
                       + (" (the fleet's own)" if job.model == FLEET else ""), code="model_mismatch")


def count_compatible(job: JobRow, models: Iterable[str | None], fleet: str | None) -> int:
    """How many of the cells (their reported models) may serve `job`."""
    return sum(1 for m in models if compatible(job.model, m, fleet))


def remember_fleet_model(store: Store, job: JobRow, model: str | None) -> None:
    """A cell registering into a `fleet` job tells the fleet's model, the first time (in the
    caller's transaction)."""
    if model and job.model == FLEET and fleet_model(store) is None:
        store.fleet.put_setting(FLEET_MODEL_KEY, model)


def registration_job(store: Store, cell_id: str, name: str | None, model: str | None) -> JobRow | None:
    """The job a registering cell asks to join (`cellflip cell --job`), checked before anything
    is recorded: it exists, is active, and runs the cell's model (None: none asked)."""
    if model is not None and not 0 < len(model) <= 512:
        raise Invalid("a cell's model is 1 to 512 characters")
    if name is None:
        return None
    row = store.jobs.get(name)
    if row is None or row.state == "deleted":
        known = ", ".join(j.name for j in store.jobs.list())
        raise NotFound(f"cell {cell_id} asks for unknown job {name!r} (jobs: {known})", code="unknown_job")
    if row.state != "active":
        raise Conflict(f"job {name!r} is {row.state}: no cell joins it", code="job_draining")
    check(store, row, cell_id, {"model": model})
    return row


def record_registration(store: Store, cell_id: str, job: JobRow | None, model: str | None) -> None:
    """In the registration's transaction: the cell under its chosen job, and the fleet's model
    told by the first cell of a `fleet` job."""
    if job is not None:
        store.jobs.assign("cell", cell_id, job.name)
    else:
        job = store.jobs.get(store.jobs.job_of("cell", cell_id))
    if job is not None:
        remember_fleet_model(store, job, model)

"""The coordinator ⇄ training-cell exchange on the coordinator's store: keys, JSON, groups.

One step attempt, one line: assign (per cell) → spec + shares → ack (with the state tag the
cell holds) → the state's source → join → joined checksums → compute → result (metrics,
checksums) → commit (or abort).

Keys under `train/` in the trainer's rendezvous store (the address every cell learns from its
`set_role training` and version commands); the store carries keys and rendezvous only. One
stateless group per attempt, formed on that store with `join_group`: `dp` (the cells only:
a joiner's state from the source rank, the gradient sums); a joiner fetching from a peer
outside the step pairs with it in a group of two (`serve`). A fresh attempt number gives
fresh group names, so a failed attempt's half-open groups never mix with the next.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import torch

from cells.engine.embedded.model_spec import ModelSpec
from cells.rl.objectives import ObjectiveConfig
from cells.training.wire import params_view

NAMESPACE = "train"


def assign_key(cell_id: str) -> str:
    return f"{NAMESPACE}/assign/{cell_id}"


def alive_key(cell_id: str) -> str:
    """Set by a training rank when it (re)connects to the coordinator's store."""
    return f"{NAMESPACE}/alive/{cell_id}"


def beat_key(cell_id: str) -> str:
    """A counter a training rank's heartbeat thread adds to every `BEAT_S`: a rank whose
    counter stands still for an op timeout is dead or stopped (no clocks compared)."""
    return f"{NAMESPACE}/beat/{cell_id}"


BEAT_S = 0.5

SKELETON_KEY = f"{NAMESPACE}/skeleton"
"""{"hyper", "params": [[name, shape], ...]}: what a training cell pre-builds its learner from."""


def skeleton(learner: Any) -> dict[str, Any]:
    return {"hyper": hyper(learner), "params": [[k, list(p.shape)] for k, p in learner.params.items()]}


def same_learner(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a learner built with hyper-parameters `a` can hold a state sent with `b` (the
    learning rate travels with the state)."""
    return {k: v for k, v in a.items() if k != "lr"} == {k: v for k, v in b.items() if k != "lr"}


def prepared_key(cell_id: str) -> str:
    """Set by a training rank each time it has prepared a learner for the next join."""
    return f"{NAMESPACE}/prepared/{cell_id}"


def attempt_prefix(step: int, attempt: int, run: str) -> str:
    return f"{NAMESPACE}/{run}/{step}/{attempt}"


def hyper(learner: Any) -> dict[str, Any]:
    """What a cell needs to build a learner like the coordinator's (state comes separately)."""
    return {"model": learner.spec.signature(), "objective": learner.objective.model_dump_json(),
            "lr": learner.lr, "betas": list(learner.betas), "weight_decay": learner.weight_decay,
            "max_grad_norm": learner.max_grad_norm, "micro_batch": learner.micro_batch,
            "minibatches": learner.minibatches, "lr_warmup_steps": learner.schedule.warmup_steps,
            "lr_schedule": learner.schedule.kind, "lr_total_steps": learner.schedule.total_steps,
            "lr_min_ratio": learner.schedule.min_ratio,
            "tile": learner.tile, "temperature": learner.temperature, "seed": learner.seed,
            "precision": getattr(learner, "precision", "fp32"),
            "activation_checkpointing": getattr(learner, "checkpointing", "off"),
            "shard_layout": getattr(learner, "shard_layout", "flat")}


def spec_from_signature(d: dict[str, Any]) -> ModelSpec:
    ranges = d.get("output_id_ranges")
    return ModelSpec(**{**d, "output_id_ranges": tuple(tuple(r) for r in ranges) if ranges else None})


def local_objective(h: dict[str, Any], local_loss: str | None) -> ObjectiveConfig:
    """The coordinator's objective, provided its loss is this process's own: a loss function
    is imported only by a name from the local configuration, never by one that came over the
    wire (that would run code the network chose)."""
    objective = ObjectiveConfig.model_validate_json(h["objective"])
    if objective.loss is not None and objective.loss != local_loss:
        raise ValueError(f"the coordinator's objective.loss {objective.loss!r} is not this cell's configured "
                         f"loss ({local_loss!r}): set trainer.objective.loss in the cell's configuration too")
    return objective


def build_learner(h: dict[str, Any], meta: dict[str, Any], flat: torch.Tensor | None = None,
                  param_storage: torch.Tensor | None = None, local_loss: str | None = None,
                  weights: dict[str, torch.Tensor] | None = None, groups: Any = None,
                  device: str | torch.device = "cpu") -> Any:
    """A learner with the coordinator's hyper-parameters and the parameters packed in `flat`
    (its reference and EWMA copy equal to them: `wire.unpack(..., held="fresh")` then writes
    only what differs), or zero parameters of the manifest's shapes without `flat`
    (`wire.unpack` then fills the whole state). `local_loss`: the custom loss of this
    process's configuration (the only one it imports); `weights`: the parameters themselves
    (the start state a rank builds); `groups` (`cells.rl.shard.ShardGroups`): a sharded
    learner, one of its cell's ranks, of the layout `h["shard_layout"]` (`gathered`: its
    slices on `device`)."""
    from cells.rl.learner import Learner
    from cells.rl.precision import set_checkpointing, set_precision

    objective = local_objective(h, local_loss)
    spec = spec_from_signature(h["model"])
    if weights is None:
        weights = (params_view(meta, flat) if flat is not None else
                   {e["name"]: torch.zeros(e["shape"]) for e in meta["entries"] if e["kind"] == "param"})
    kw: dict[str, Any] = {"param_storage": param_storage}
    cls: Any = Learner
    if groups is not None:
        cls, kw = sharded_class(h), {"groups": groups}
        if h.get("shard_layout") == "gathered":
            kw["device"] = device
    learner = cls(replace(spec), weights, lr=float(h["lr"]),
                      objective=objective, tile=h["tile"],
                      temperature=float(h["temperature"]), weight_decay=float(h["weight_decay"]),
                      betas=tuple(h["betas"]), max_grad_norm=h["max_grad_norm"], micro_batch=int(h["micro_batch"]),
                      minibatches=int(h["minibatches"]), lr_warmup_steps=int(h["lr_warmup_steps"]),
                      lr_schedule=h.get("lr_schedule", "constant"), lr_total_steps=h.get("lr_total_steps"),
                      lr_min_ratio=float(h.get("lr_min_ratio", 0.1)), seed=int(h.get("seed", 0)), **kw)
    set_precision(learner, h.get("precision", "fp32"))
    set_checkpointing(learner, h.get("activation_checkpointing", "off"))
    learner.shard_layout = h.get("shard_layout", "flat")
    return learner


def sharded_class(h: dict[str, Any]) -> Any:
    """The learner class of a cell rank for `trainer.shard_layout`."""
    layout = h.get("shard_layout", "flat")
    if layout == "flat":
        from cells.rl.shard import ShardedLearner

        return ShardedLearner
    if layout == "gathered":
        from cells.rl.shard_gathered import GatheredLearner

        return GatheredLearner
    raise ValueError(f"unknown trainer.shard_layout {layout!r}: flat or gathered")


def build_skeleton(sk: dict[str, Any], param_storage: torch.Tensor | None = None,
                   local_loss: str | None = None) -> Any:
    """A learner of the skeleton's shapes with every tensor of a training state allocated and
    touched (zero parameters, reference, EWMA copy, AdamW moments): a join writes the state
    into it in place (`wire.unpack(..., held="warm")`). `param_storage`: where the parameters
    live (the front of the buffer a joining state is received into: they arrive in place)."""
    learner = build_learner(sk["hyper"], {"entries": [{"kind": "param", "name": n, "shape": s}
                                                      for n, s in sk["params"]]}, param_storage=param_storage,
                            local_loss=local_loss)
    for p in learner.params.values():
        learner.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape),
                                      "exp_avg_sq": torch.zeros(p.shape)}
    return learner


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def holds_key(cell_id: str) -> str:
    """{"tag", "version", "checksum", "commit"}: the committed state a cell holds (set by the
    cell whenever that changes and when it connects; deleted when it holds none)."""
    return f"{NAMESPACE}/holds/{cell_id}"


def holds(store, cell_id: str, tag: str | None) -> bool:
    if tag is None or not store.check([holds_key(cell_id)]):
        return False
    return json.loads(store.get(holds_key(cell_id))).get("tag") == tag


def hyper_of(spec: ModelSpec, objective: ObjectiveConfig, *, lr: float, minibatches: int,
             tile: int | None, temperature: float, lr_warmup_steps: int = 0, lr_schedule: str = "constant",
             lr_total_steps: int | None = None, lr_min_ratio: float = 0.1, betas=(0.9, 0.999),
             weight_decay: float = 0.0, max_grad_norm: float | None = 1.0, micro_batch: int = 16,
             seed: int = 0, precision: str = "fp32", activation_checkpointing: str = "off",
             shard_layout: str = "flat") -> dict[str, Any]:
    """`hyper` from configuration, without building a learner (the trainer holds none);
    `seed`: the learner's sampling generator (the warm-up's batches)."""
    return {"model": spec.signature(), "objective": objective.model_dump_json(), "lr": lr, "betas": list(betas),
            "weight_decay": weight_decay, "max_grad_norm": max_grad_norm, "micro_batch": micro_batch,
            "minibatches": minibatches, "lr_warmup_steps": lr_warmup_steps, "lr_schedule": lr_schedule,
            "lr_total_steps": lr_total_steps, "lr_min_ratio": lr_min_ratio, "tile": tile,
            "temperature": temperature, "seed": seed, "precision": precision,
            "activation_checkpointing": activation_checkpointing, "shard_layout": shard_layout}


def param_shapes(spec: ModelSpec) -> list[list]:
    """[[name, shape], ...] of the model's parameters, computed without allocating them."""
    from cells.engine.embedded.model import weight_shapes

    return [[k, list(s)] for k, s in weight_shapes(spec).items()]

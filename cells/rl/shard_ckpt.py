"""A sharded learner's snapshot and one-rank checkpoint format (`SliceCheckpoints`, a base of
`cells.rl.shard.ShardedLearner` and so of `GatheredLearner`).

The guard's snapshot is this rank's slices of what an update changes (master, moments, EWMA
copy), kept in host memory (pinned where the slices live on a GPU). `state_dict` gathers the
one-rank learner's checkpoint format from the cell's slices (every rank calls it: a
collective; the cell's rank 0 writes it); `load_state_dict` keeps this rank's slices of one.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from cells.rl.learner import Learner
from cells.rl.objectives import PPOEWMA
from cells.transport.p2p import wait_work


def all_gather(pg: Any, flat: Tensor, piece: Tensor, timeout_s: float) -> None:
    """`flat` (S·L) := every rank's `piece` (L) in rank order."""
    n = piece.numel()
    outs = [flat[r * n: (r + 1) * n] for r in range(flat.numel() // n)]
    wait_work(pg.allgather([outs], [piece]), timeout_s, f"all-gather ({flat.numel()} values)")


class SliceCheckpoints:
    """Snapshot and checkpoint methods over a sharded learner's slices (`master`, `ref_shard`,
    `ewma.inner`, the optimizer's state of `master`)."""

    host: torch.device = torch.device("cpu")

    def _host_copy(self, t: Tensor) -> Tensor:
        """A host copy of `t` (pinned where this rank's slices live on a GPU)."""
        pin = self.master.device.type == "cuda"
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        return out.copy_(t.detach())

    def take_snapshot(self) -> dict[str, Any]:
        """This rank's slices of what an update changes (the guard's and the worker's snapshot)."""
        st = self.optimizer.state.get(self.master) or {}
        prev = getattr(self, "_snap", None) or {"moments": {}}

        def keep(t: Tensor, old: Tensor | None) -> Tensor:  # into the last snapshot's tensors (obsolete now)
            return old.copy_(t) if old is not None and old.shape == t.shape else self._host_copy(t)

        self._snap = {"master": keep(self.master.detach(), prev.get("master")),
                      "moments": {k: keep(v, prev["moments"].get(k)) for k, v in st.items()},
                      "ewma": keep(self.ewma.inner.params["shard"], prev.get("ewma")),
                      "ewma_weight": self.ewma.inner.weight, "ewma_resets": self.ewma.inner.num_resets,
                      "step": self.step}
        return self._snap

    @torch.no_grad()
    def restore_snapshot(self, snap: dict[str, Any], gather: bool = True) -> None:
        """Back to `snap` (copies), the compute copy gathered from the restored slices (later,
        `gather` off: after a failed attempt the cell's group is gone; `stale_copy` says so)."""
        self.master.copy_(snap["master"])
        self.master.grad = None
        dev = self.master.device
        if snap["moments"]:
            self.optimizer.state[self.master] = {k: v.to(dev, copy=True) for k, v in snap["moments"].items()}
        else:
            self.optimizer.state.pop(self.master, None)
        self.ewma.inner.params["shard"].copy_(snap["ewma"])
        self.ewma.inner.weight, self.ewma.inner.num_resets = snap["ewma_weight"], snap["ewma_resets"]
        self.step = snap["step"]
        self.stale_copy = not gather
        if gather:
            self.gather_params()

    def state_dict(self) -> dict[str, Any]:
        """The one-rank learner's checkpoint format (cells/training/state_files.py), gathered
        from the cell's slices to host memory: every rank of the cell calls it (a collective);
        the cell's rank 0 writes it."""
        g = self.groups
        whole = {}
        st = self.optimizer.state.get(self.master) or {}
        pieces = {"params": self.master, "reference": self.ref_shard, "ewma": self.ewma.inner.params["shard"],
                  **{s: st[s] for s in ("exp_avg", "exp_avg_sq") if s in st}}
        for name, piece in pieces.items():
            flat = torch.empty(self.shard_len * g.cell_size, device=self.master.device)
            all_gather(g.cell, flat, piece.detach().to(flat.device).contiguous(), g.timeout_s)
            whole[name] = {k: v.to("cpu", copy=True) for k, v in self._views(flat).items()}
            del flat
        return Learner.state_dict(self._as_one(whole, st))

    def _as_one(self, whole: dict[str, dict[str, Tensor]], st: dict[str, Tensor]) -> Any:
        """A stand-in with the one-rank learner's attributes, for `Learner.state_dict`."""
        params = whole["params"]
        opt = torch.optim.AdamW([params[k] for k in self.names], lr=self._base_lr, betas=self.betas,
                                weight_decay=self.weight_decay, fused=True)
        if st:
            for k in self.names:
                opt.state[params[k]] = {"step": st["step"].to("cpu", copy=True), "exp_avg": whole["exp_avg"][k],
                                        "exp_avg_sq": whole["exp_avg_sq"][k]}
        ewma = PPOEWMA(whole["ewma"], staleness_window=1.0)
        ewma.weight, ewma.num_resets = self.ewma.inner.weight, self.ewma.inner.num_resets
        one = object.__new__(Learner)
        one.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("optimizer", "ewma")})
        one.__dict__.update({"optimizer": opt, "ewma": ewma, "reference": whole["reference"], "params": params})
        return one

    @torch.no_grad()
    def _load_params(self, params: dict[str, Tensor]) -> None:
        """The parameters of a one-rank checkpoint into this learner (its compute copy)."""
        for k, p in self.params.items():
            p.copy_(params[k])

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a one-rank checkpoint (`state_dict()`'s format): this rank keeps its slices."""
        meta = state["meta"]
        if list(meta["param_names"]) != self.names:
            raise ValueError("the checkpoint's parameter names differ from this learner's")
        if meta["spec"] != json.dumps(self.spec.signature(), sort_keys=True):
            raise ValueError("the checkpoint was written for another model spec")
        self._load_params(state["params"])
        self.ref_shard = self._host_copy(self._slice_of(state["reference"]))
        ew = dict(state["ewma"])
        self.ewma.inner.weight = float(ew.pop("__ewma_weight__"))
        self.ewma.inner.params = {"shard": self._host_copy(self._slice_of(ew))}
        self.ewma.inner.num_resets = int(meta["ewma_num_resets"])
        opt, dev = state["optimizer"], self.master.device
        self.optimizer.state.pop(self.master, None)
        if opt["state"]:
            per = {self.names[int(i)]: v for i, v in opt["state"].items()}
            self.optimizer.state[self.master] = {
                "step": next(iter(per.values()))["step"].to(dev, copy=True),
                **{s: self._slice_of({k: per[k][s] for k in self.names}).to(dev)
                   for s in ("exp_avg", "exp_avg_sq")}}
        self._base_lr = float(opt["param_groups"][0]["lr"])
        self.generator.set_state(state["rng"])
        self.version, self.step, self.cursor = int(meta["version"]), int(meta["step"]), int(meta["cursor"])
        start = meta.get("rl_start_step")
        self.rl_start_step = None if start is None else int(start)

"""`GatheredLearner` (cells/rl/shard_gathered.py) as the cells run it (`trainer.shard_layout:
gathered`): its supervised warm-up on S ranks equal to one process's, its one-rank checkpoint
read back unchanged, its bf16 gradient slice within the bf16-vs-fp32 difference of one process
in bf16, and its state on the device it is given (checked on the meta device: no data, every
placement visible), the reference, EWMA and snapshot slices in host memory."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cells.engine.embedded.model import init_weights
from cells.rl.layer_gather import FlatLayout, LayerGather
from cells.rl.precision import set_precision
from cells.rl.shard import ShardGroups
from cells.rl.shard_gathered import GatheredLearner, adamw_chunks
from cells.training.shard_ranks import launch, spec_of

torch.set_num_threads(1)

BASE = {"preset": "toy", "spec": {"vocab_size": 1024, "output_id_ranges": [[0, 48]], "max_position": 256},
        "lr": 2e-3, "minibatches": 2, "groups": 2, "timeout_s": 60}
SFT = {**BASE, "updates": 1, "shares": [1, 2], "sft": {"steps": 3, "batch_size": 3}, "save_every": True}
"""Three warm-up steps (every rank of the cell on the same demonstrations), then one RL update."""
BF16 = {**BASE, "updates": 2, "shares": [1, 1, 2, 2], "save_every": True}


def _rel_diff(a: dict, b: dict) -> float:
    w0 = init_weights(spec_of(BASE), 0, 0.02)
    out = 0.0
    for k in a:
        moved = float((a[k] - w0[k]).norm())
        assert moved > 0, k
        out = max(out, float((a[k] - b[k]).norm()) / moved)
    return out


def test_state_lives_on_the_given_device_and_the_host_slices_on_the_host():
    spec = spec_of(BASE)
    lrn = GatheredLearner(spec, init_weights(spec, 0, 0.02), groups=ShardGroups(None, 1, 2), lr=1e-3, device="meta")
    set_precision(lrn, "bf16")
    lrn.zero_grads()
    adamw_chunks(lrn.optimizer, lrn.master, lrn.grad_slice, 0.5, 1e-3, chunk=4096)
    on_device = [lrn.master, lrn.grad_slice, *lrn._rope, *lrn.optimizer.state[lrn.master].values()]
    assert all(t.device.type == "meta" for t in on_device)
    assert lrn.grad_slice.dtype == torch.bfloat16 and lrn.master.dtype == torch.float32
    assert all(v.dtype == torch.float32 for k, v in lrn.optimizer.state[lrn.master].items())
    assert lrn.ref_shard.device.type == "cpu" and lrn.ewma.inner.params["shard"].device.type == "cpu"
    # every forward's source computes on the device, also the reference's and EWMA's host slices
    assert all(lrn._kind_source(k).device.type == "meta" for k in range(4))
    assert lrn._kind_source(2).shard.device.type == "cpu"
    one = LayerGather(spec, FlatLayout(dict(lrn._shapes), 1, 0), None)
    assert one.gather_range(torch.zeros(lrn.num_params), 0, 64, device=torch.device("meta")).device.type == "meta"
    # negative control: without a device the same learner's state is host memory
    host = GatheredLearner(spec, init_weights(spec, 0, 0.02), groups=ShardGroups(None, 1, 2), lr=1e-3)
    assert host.master.device.type == "cpu" and host._kind_source(0).device.type == "cpu"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_warm_up_checkpoint_and_bf16_gradient_slice_on_gathered_ranks(tmp_path: Path):
    g = {"gather_layers": True, "device": "cpu"}
    runs = {"one_sft": (0, 0, SFT), "sft": (1, 2, {**SFT, **g, "checkpoint": True}),
            "undivided": (1, 2, {**SFT, **g, "sft_undivided": True, "sft": {"steps": 1, "batch_size": 3},
                                 "updates": 0}),
            "one_fp32": (0, 0, BF16), "one_bf16": (0, 0, {**BF16, "precision": "bf16"}),
            "bf16": (2, 2, {**BF16, **g, "precision": "bf16"})}
    with ThreadPoolExecutor(len(runs)) as ex:
        futs = {k: ex.submit(launch, c, s, cfg, tmp_path / k, 280) for k, (c, s, cfg) in runs.items()}
        res = {k: f.result() for k, f in futs.items()}
    theta = {k: load_file(str(tmp_path / k / "params.safetensors")) for k in runs if k != "undivided"}
    # the warm-up: each step's loss and gradient norm as one process's, then the RL update
    one, two, undiv = res["one_sft"][0]["sft"], res["sft"][0]["sft"], res["undivided"][0]["sft"]
    assert len(two) == 3 and all(r["sft"] == two for r in res["sft"])  # every rank, the same steps
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    # negative control: without the division by S the per-layer reduce sums two copies
    assert abs(undiv[0]["grad_norm"] - 2 * one[0]["grad_norm"]) <= 1e-3 * one[0]["grad_norm"]
    d = _rel_diff(theta["one_sft"], theta["sft"])
    print("warm-up + update on 2 gathered ranks vs one process:", d)
    assert d <= 1e-4
    before = load_file(str(tmp_path / "one_sft" / "params_u0.safetensors"))  # warmed up, before the update
    assert _rel_diff(theta["one_sft"], before) > 1e-2  # negative control: the update is seen
    # the one-rank checkpoint format gathered from the slices, read back into them unchanged
    assert all(r["reload_equal"] for r in res["sft"])
    # bf16 with a bf16 gradient slice: as close to one process in bf16 as bf16 is to fp32
    bf, ref = _rel_diff(theta["one_bf16"], theta["bf16"]), _rel_diff(theta["one_fp32"], theta["one_bf16"])
    control = _rel_diff(load_file(str(tmp_path / "one_bf16" / "params_u1.safetensors")), theta["bf16"])
    print("bf16: 2x2 gathered vs one process", bf, "one process bf16 vs fp32", ref, "control", control)
    assert bf <= ref
    assert control > ref  # negative control: one update fewer is past the bound


def test_shard_layout_is_checked_and_picks_the_learner_a_cell_rank_builds():
    from pydantic import ValidationError

    from cells.rl.shard import ShardedLearner
    from cells.training import protocol as P
    from scheduler.contract.config.trainer import TrainerConfig
    from tests.training.cluster import learner

    assert TrainerConfig().shard_layout == "flat" and TrainerConfig(shard_layout="gathered").shard_layout == "gathered"
    with pytest.raises(ValidationError):
        TrainerConfig(shard_layout="zero3")
    one = learner()
    zeros = {k: torch.zeros_like(v) for k, v in one.params.items()}
    built = {}
    for layout in ("flat", "gathered"):
        h = {**P.hyper(one), "shard_layout": layout}
        built[layout] = P.build_learner(h, {"entries": []}, weights=zeros, groups=ShardGroups(None, 0, 2))
        assert P.build_learner(h, {"entries": []}, weights=zeros).__class__.__name__ == "Learner"  # one rank
    assert type(built["gathered"]) is GatheredLearner and type(built["flat"]) is ShardedLearner
    assert built["gathered"].shard_layout == "gathered" and P.hyper(built["gathered"])["shard_layout"] == "gathered"
    with pytest.raises(ValueError, match="unknown trainer.shard_layout 'zero3'"):
        P.build_learner({**P.hyper(one), "shard_layout": "zero3"}, {"entries": []}, weights=zeros,
                        groups=ShardGroups(None, 0, 2))

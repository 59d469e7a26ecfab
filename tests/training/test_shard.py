"""A cell's training role as S ranks (cells/rl/shard.py): 2 cells x 2 ranks over gloo, the
state sharded inside each cell, rank i of each cell reducing with rank i of the other, equal
to one process's update; each rank holds about half the state."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cells.engine.embedded.model import init_weights
from cells.training import state_files
from cells.training.shard_ranks import launch, spec_of

CFG = {"preset": "toy", "spec": {"vocab_size": 1024, "output_id_ranges": [[0, 48]], "max_position": 256},
       "lr": 2e-3, "minibatches": 2, "updates": 2, "groups": 2, "shares": [1, 1, 2, 2], "timeout_s": 60}


C3 = {**CFG, "updates": 3, "groups": 4}
"""Three updates of four groups: the ranks' start-of-update forwards differ in number and kind
(the reference moved away from the parameters, EWMA forwards on some ranks only)."""


def _rel_diff(a: dict, b: dict) -> float:
    w0 = init_weights(spec_of(CFG), 0, 0.02)
    out = 0.0
    for k in a:
        moved = float((a[k] - w0[k]).norm())
        assert moved > 0, k  # the updates moved every tensor: the comparison compares something
        out = max(out, float((a[k] - b[k]).norm()) / moved)
    return out


@pytest.mark.timeout(330)
def test_two_cells_of_two_ranks_equal_one_process(tmp_path: Path):
    ck = {**CFG, "checkpoint": True}
    runs = {"one": (0, 0, ck), "sharded": (2, 2, ck), "alone": (2, 2, {**CFG, "skip_cross": True}),
            "rejected": (2, 2, {**CFG, "max_update_kl": 1e-12}), "one3": (0, 0, C3),
            "gathered": (2, 2, {**C3, "gather_layers": True})}
    with ThreadPoolExecutor(len(runs)) as ex:  # the runs at once (their start-up is most of the time)
        futs = {k: ex.submit(launch, c, s, cfg, tmp_path / k, 280) for k, (c, s, cfg) in runs.items()}
        one, sharded, rejected = futs["one"].result(), futs["sharded"].result(), futs["rejected"].result()
        gathered = futs["gathered"].result()
        futs["alone"].result()
    theta = {k: load_file(str(tmp_path / d / "params.safetensors")) for k in runs if (d := k) != "rejected"}
    assert _rel_diff(theta["one"], theta["sharded"]) <= 1e-4
    # the compute weights gathered a layer at a time (cells/rl/shard_gathered.py): the same
    # updates, and a rank holds its slices only: 36/S B/param at rest (master 4, moments 8,
    # reference 4, EWMA 4, snapshot 16), not the compute copy's 4 + 32/S
    assert _rel_diff(theta["one3"], theta["gathered"]) <= 1e-4
    assert all(r["steps"][0]["num_trees"] == 4 for r in gathered)
    assert all(r["rank_state_bytes"] <= 1.05 * 36 * one[0]["params"] / 2 for r in gathered)
    assert all(r["rank_state_bytes"] > 1.05 * 36 * one[0]["params"] / 2 for r in sharded)  # negative control
    # negative control: without the cross-cell reduction each cell trains on its own data
    assert _rel_diff(theta["one"], theta["alone"]) > 1e-2
    assert all(r["steps"][0]["num_trees"] == 2 for r in sharded)  # the trees reached every rank's sum
    # each rank holds its half of moments, reference, EWMA and snapshot, and the compute copy
    params = one[0]["params"]
    assert one[0]["rank_state_bytes"] >= 38 * params
    assert all(r["rank_state_bytes"] <= 1.25 * 40 * params / 2 for r in sharded)
    # the checkpoint: the one-rank format gathered from the slices, read back into them unchanged
    assert all(r["reload_equal"] for r in sharded + one)
    a, b = state_files.load_state(tmp_path / "one" / "state"), state_files.load_state(tmp_path / "sharded" / "state")
    assert a["meta"] == b["meta"]
    assert all(torch.equal(a["reference"][k], b["reference"][k]) for k in a["reference"])
    for i, st in a["optimizer"]["state"].items():
        for s in ("exp_avg", "exp_avg_sq"):
            x, y = st[s], b["optimizer"]["state"][i][s]
            assert float((x - y).norm()) <= 1e-3 * float(x.norm()) + 1e-12, (i, s)
    assert _rel_diff(theta["one"], b["params"]) <= 1e-4
    # the guard's snapshot on slices: every update rejected leaves the start state bitwise
    assert all(s["rejected"] == 1.0 for r in rejected for s in r["steps"])
    w0 = init_weights(spec_of(CFG), 0, 0.02)
    back = load_file(str(tmp_path / "rejected" / "params.safetensors"))
    assert all(torch.equal(back[k], w0[k]) for k in w0)
    assert not all(torch.equal(theta["sharded"][k], w0[k]) for k in w0)  # negative control

"""A cell's training role as S ranks (cells/rl/shard.py): 2 cells x 2 ranks over gloo, the
state sharded inside each cell, rank i of each cell reducing with rank i of the other, equal
to one process's update; each rank holds about half the state."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cells.engine.embedded.model import init_weights
from cells.rl.shard_ranks import launch, spec_of

CFG = {"preset": "toy", "spec": {"vocab_size": 1024, "output_id_ranges": [[0, 48]], "max_position": 256},
       "lr": 2e-3, "minibatches": 2, "updates": 2, "groups": 2, "shares": [1, 1, 2, 2], "timeout_s": 60}


def _rel_diff(a: dict, b: dict) -> float:
    w0 = init_weights(spec_of(CFG), 0, 0.02)
    out = 0.0
    for k in a:
        moved = float((a[k] - w0[k]).norm())
        assert moved > 0, k  # the updates moved every tensor: the comparison compares something
        out = max(out, float((a[k] - b[k]).norm()) / moved)
    return out


@pytest.mark.timeout(300)
def test_two_cells_of_two_ranks_equal_one_process(tmp_path: Path):
    runs = {"one": (0, 0, CFG), "sharded": (2, 2, CFG), "alone": (2, 2, {**CFG, "skip_cross": True})}
    with ThreadPoolExecutor(3) as ex:  # the three runs at once (their start-up is most of the time)
        futs = {k: ex.submit(launch, c, s, cfg, tmp_path / k, 240) for k, (c, s, cfg) in runs.items()}
        one, sharded = futs["one"].result(), futs["sharded"].result()
        futs["alone"].result()
    theta = {k: load_file(str(tmp_path / d / "params.safetensors")) for k, d in
             (("one", "one"), ("sharded", "sharded"), ("alone", "alone"))}
    assert _rel_diff(theta["one"], theta["sharded"]) <= 1e-4
    # negative control: without the cross-cell reduction each cell trains on its own data
    assert _rel_diff(theta["one"], theta["alone"]) > 1e-2
    assert all(r["steps"][0]["num_trees"] == 2 for r in sharded)  # the trees reached every rank's sum
    # each rank holds its half of moments, reference, EWMA and snapshot, and the compute copy
    params = one[0]["params"]
    assert one[0]["rank_state_bytes"] >= 38 * params
    assert all(r["rank_state_bytes"] <= 1.25 * 40 * params / 2 for r in sharded)

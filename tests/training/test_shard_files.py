"""A sharded cell's checkpoint in one process (no groups needed: reading and writing slices is
local): a one-rank checkpoint sliced into 2 ranks, their shards written and re-sharded into 3,
every slice bitwise the one-rank state's; shards of another commit, or not covering a cell,
are refused with the reason; a slice is installed only into the rank it belongs to."""

from __future__ import annotations

import json

import pytest
import torch

from cells.rl.shard import ShardGroups
from cells.rl.shard_state import install_shard, pack_shard
from cells.training import protocol as P
from cells.training import shard_files, state_files
from cells.training.wire import pack
from cells.training.worker import _extras
from tests.training.cluster import learner, trajectories

torch.set_num_threads(1)


def _whole(one) -> dict[str, torch.Tensor]:
    names = sorted(one.params)
    st = [one.optimizer.state[one.params[k]] for k in names]
    return {"master": torch.cat([one.params[k].detach().reshape(-1) for k in names]),
            "reference": torch.cat([one.reference[k].reshape(-1) for k in names]),
            "ewma": torch.cat([one.ewma.params[k].reshape(-1) for k in names]),
            "exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in st]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in st])}


def _slices(ranks) -> dict[str, torch.Tensor]:
    p = ranks[0].num_params
    return {"master": torch.cat([r.master.detach() for r in ranks])[:p],
            "reference": torch.cat([r.ref_shard for r in ranks])[:p],
            "ewma": torch.cat([r.ewma.inner.params["shard"] for r in ranks])[:p],
            "exp_avg": torch.cat([r.optimizer.state[r.master]["exp_avg"] for r in ranks])[:p],
            "exp_avg_sq": torch.cat([r.optimizer.state[r.master]["exp_avg_sq"] for r in ranks])[:p]}


def _ranks(one, n: int, layout: str = "flat") -> list:
    zeros = {k: torch.zeros_like(v) for k, v in one.params.items()}
    h = {**P.hyper(one), "shard_layout": layout}
    return [P.build_learner(h, {"entries": []}, weights=zeros, groups=ShardGroups(None, r, n), device="cpu")
            for r in range(n)]


@pytest.mark.parametrize("layout", ["flat", "gathered"])
def test_a_one_rank_checkpoint_slices_into_two_ranks_and_reshards_into_three(tmp_path, layout):
    """Either layout (`trainer.shard_layout`): the gathered learner's slices are the same
    files (its one-rank format read through `load_state_dict`, its parameters the master)."""
    one = learner(max_grad_norm=1.0)
    for s in (0, 1):
        one.rl_step(trajectories(one, seed=s))
    meta, flat, idx = pack(one)
    commit = {"tag": "run:2:2", "version": 2}
    state_files.save_state(tmp_path / "one", {"state": {"meta": {**meta, **_extras(one)}, "values": flat,
                                                        "rows": idx}, "commit": commit})
    want = _whole(one)
    two = _ranks(one, 2, layout)
    assert type(two[0]).__name__ == {"flat": "ShardedLearner", "gathered": "GatheredLearner"}[layout]
    for r in two:
        shard_files.load_into(r, str(tmp_path / "one"), P.hyper(one), None)
    got = _slices(two)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all((r.version, r.step) == (one.version, one.step) for r in two)
    # each rank writes its shard, then the index; a cell of 3 ranks re-shards them
    for r in two:
        shard_files.write_shard(r, str(tmp_path / "two"), "shards-a", commit)
    shard_files.write_index(str(tmp_path / "two"), "shards-a", 2, commit)
    three = _ranks(one, 3, layout)
    for r in three:
        shard_files.load_into(r, str(tmp_path / "two"), P.hyper(one), None)
    got = _slices(three)
    assert all(torch.equal(got[k], want[k]) for k in want)
    shapes = {k: list(v.shape) for k, v in one.params.items()}
    params = shard_files.load_params(str(tmp_path / "two"), shapes)
    assert all(torch.equal(params[k], one.params[k].detach()) for k in shapes)
    # negative control: a moved parameter is seen
    one.params[sorted(shapes)[0]].data.add_(1e-3)
    assert not all(torch.equal(params[k], one.params[k].detach()) for k in shapes)


def test_shards_of_another_commit_or_of_another_rank_are_refused(tmp_path):
    one = learner()
    one.rl_step(trajectories(one, seed=0))
    two = _ranks(one, 2)
    ws = one.params
    for r in two:  # the parameters, sliced (the moments stay empty)
        r.load_state_dict({**one.state_dict(), "params": ws})
    shard_files.write_shard(two[0], str(tmp_path), "shards-a", {"tag": "a"})
    shard_files.write_shard(two[1], str(tmp_path), "shards-a", {"tag": "b"})  # written for another commit
    shard_files.write_index(str(tmp_path), "shards-a", 2, {"tag": "a"})
    fresh = _ranks(one, 2)
    shard_files.load_into(fresh[0], str(tmp_path), P.hyper(one), None)
    with pytest.raises(state_files.StateFileError, match="holds commit b, not the index's a"):
        shard_files.load_into(fresh[1], str(tmp_path), P.hyper(one), None)
    meta, flat = pack_shard(two[1])
    with pytest.raises(ValueError, match="shard 1 of 2 is not this rank's"):
        install_shard(fresh[0], meta, flat)
    with pytest.raises(ValueError, match="a cell of one rank holds the whole state"):
        install_shard(fresh[0], {**meta, "format": "cellflip-state/1"}, flat)
    json.dumps(meta)  # the manifest is JSON

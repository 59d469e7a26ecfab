"""Compute weights gathered one layer at a time over a cell's ranks (cells/rl/layer_gather.py,
cells/rl/layer_forward.py): two ranks over gloo (threads of this process), each with its slice
of the flat layout and its own sequences, three AdamW updates on the slices equal one
process's updates on the whole model; no rank ever holds more than two units gathered; the
published (gathered) parameters are the slices'."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from cells.engine.embedded.model import init_weights, prepare, token_logprobs
from cells.engine.embedded.model_spec import PRESETS
from cells.rl.layer_forward import empty_forward, packed_logprobs
from cells.rl.layer_gather import FlatLayout, LayerGather, Source

SPEC = replace(PRESETS["toy"], vocab_size=1024, output_id_ranges=((0, 48),), max_position=256, num_layers=6)
S, STEPS, LR = 2, 3, 1e-2


def _batches() -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Per step, per rank: its micro-batches, each a list of (ids, per-token loss weights);
    rank 0 runs two micro-batches, rank 1 one (it pads with an empty forward)."""
    g = torch.Generator().manual_seed(7)

    def seq(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 48, (n,), generator=g), torch.randn(n, generator=g)

    return [[[[seq(9), seq(14)], [seq(6)]], [[seq(11), seq(5), seq(17)]]] for _ in range(STEPS)]


def _flat(w: dict[str, torch.Tensor], lay: FlatLayout) -> torch.Tensor:
    flat = torch.cat([w[k].reshape(-1) for k in sorted(w)])
    return torch.cat([flat, flat.new_zeros(lay.shard_len * lay.size - flat.numel())])


def _one_process(w0: dict[str, torch.Tensor], batches, dtype=None) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.01)
    for step in batches:
        opt.zero_grad()
        prep = prepare(SPEC, params, dtype=dtype)
        loss = sum((token_logprobs(prep, ids) * c[1:]).sum() for rank in step for mb in rank for ids, c in mb)
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def _rank(rank: int, store, w0, batches, reduce: bool, dtype) -> dict:
    pg = ProcessGroupGloo(PrefixStore("cell", store), rank, S, timedelta(seconds=60))
    lay = FlatLayout({k: v.shape for k, v in w0.items()}, S, rank)
    lg = LayerGather(SPEC, lay, pg, timeout_s=60, reduce=reduce, dtype=dtype)
    master = _flat(w0, lay)[rank * lay.shard_len: (rank + 1) * lay.shard_len].clone().requires_grad_(True)
    opt = torch.optim.AdamW([master], lr=LR, weight_decay=0.01)
    for step in batches:
        src = Source(master.detach())
        mbs = step[rank]
        for i in range(lg.lockstep_rounds(len(mbs))):
            if i >= len(mbs):
                empty_forward(lg, src, grad=True)
                continue
            lps = packed_logprobs(lg, src, [ids for ids, _ in mbs[i]], grad=True)
            sum((lp.float() * c).sum() for lp, (_, c) in zip(lps, mbs[i], strict=True)).backward()
        master.grad = src.grad
        opt.step()
    full = lg.gather_full(Source(master.detach()))
    return {"master": master.detach().clone(), "full": full, "peak": lg.peak_live, "layout": lay,
            "units": {k: b - a for k, (a, b) in lg.units.items()}}


def _sharded(w0, batches, reduce: bool = True, dtype=None) -> list[dict]:
    store = HashStore()
    with ThreadPoolExecutor(S) as ex:
        futs = [ex.submit(_rank, r, store, w0, batches, reduce, dtype) for r in range(S)]
        return [f.result(timeout=120) for f in futs]


def _rel_diff(a: dict, b: dict, w0: dict) -> float:
    out = 0.0
    for k in w0:
        moved = float((a[k] - w0[k]).norm())
        assert moved > 0, k  # the updates moved every tensor: the comparison compares something
        out = max(out, float((a[k] - b[k]).norm()) / moved)
    return out


def _assembled(ranks: list[dict], w0: dict) -> dict[str, torch.Tensor]:
    flat, lay, out = torch.cat([r["master"] for r in ranks]), ranks[0]["layout"], {}
    for k, v in w0.items():
        o = lay.offsets[k]
        out[k] = flat[o: o + v.numel()].view(v.shape)
    return out


@pytest.mark.timeout(120)
def test_two_ranks_gathering_layers_update_like_one_process():
    torch.manual_seed(0)
    w0, batches = init_weights(SPEC, 0, 0.02), _batches()
    one = _one_process(w0, batches)
    ranks = _sharded(w0, batches)
    theta = _assembled(ranks, w0)
    print("fp32 2-rank vs one process:", _rel_diff(one, theta, w0))
    assert _rel_diff(one, theta, w0) <= 1e-4
    # publishing: every rank gathers the whole model, unit by unit, equal to the slices bitwise
    for r in ranks:
        assert all(torch.equal(r["full"][k], theta[k]) for k in w0)
    # no rank held the model: a unit or two gathered at once (a third while gloo's thread lets
    # go of a received buffer a moment after the wait)
    units = sorted(ranks[0]["units"].values())
    num_params = sum(v.numel() for v in w0.values())
    assert all(0 < r["peak"] <= 2 * units[-1] + units[-2] < num_params / 2 for r in ranks), (
        [r["peak"] for r in ranks], units, num_params)
    # negative control: without the reduce to the owners each rank steps on its own gradient
    alone = _assembled(_sharded(w0, batches, reduce=False), w0)
    print("negative control (no reduce):", _rel_diff(one, alone, w0), "peaks", [r["peak"] for r in ranks],
          "units", units, "params", num_params)
    assert _rel_diff(one, alone, w0) > 1e-2


@pytest.mark.timeout(120)
def test_bf16_gathers_and_reduces_stay_within_bf16_of_one_process():
    """bf16 compute and wire, fp32 slices: the 2-rank run is nearer one process in bf16 than
    bf16 is to fp32 (the issue's criterion), and not bitwise the fp32 run (the dtype took)."""
    w0, batches = init_weights(SPEC, 0, 0.02), _batches()
    one32, one16 = _one_process(w0, batches), _one_process(w0, batches, torch.bfloat16)
    ranks = _sharded(w0, batches, dtype=torch.bfloat16)
    theta = _assembled(ranks, w0)
    print("bf16 2-rank vs one bf16:", _rel_diff(one16, theta, w0), "bf16 vs fp32:", _rel_diff(one32, one16, w0))
    assert _rel_diff(one16, theta, w0) <= _rel_diff(one32, one16, w0)
    assert _rel_diff(one32, theta, w0) > 1e-4
    for r in ranks:  # published from the fp32 slices, not the bf16 compute copies
        assert all(torch.equal(r["full"][k], theta[k]) for k in w0)


def test_bad_input_is_refused():
    lay = FlatLayout({k: torch.Size(s) for k, s in {"a": (3,), "b": (4,)}.items()}, 2, 0)
    assert lay.shard_len == 4 and lay.pieces(2, 6) == [(0, 2, 4), (1, 4, 6)]
    with pytest.raises(ValueError, match="contiguous"):
        FlatLayout({"a": torch.Size((3,)), "b": torch.Size((4,)), "c": torch.Size((2,))}, 2, 0).span(["a", "c"])
    lg = LayerGather(SPEC, FlatLayout({k: v.shape for k, v in init_weights(SPEC).items()}, 1, 0), None)
    with pytest.raises(ValueError, match="2 tokens"):
        packed_logprobs(lg, Source(torch.zeros(lg.layout.shard_len)), [torch.tensor([3])], grad=False)


def test_the_memory_formula_at_32b_is_the_documented_one():
    """docs/TRAINING.md's figures for the layer-gathered layout at Qwen3-32B on 8 GPUs."""
    from cells.rl.memory import QWEN3_32B, Config, layer_gathered, sharded_compute

    g = 1e9
    bf16 = layer_gathered(Config(QWEN3_32B, 8, 8192, "nccl", "layer", 2))
    # bf16: the gradient slice bf16 too (14/8 B/param of slices): fits the 72 GB goal at T = 8,192
    assert round(bf16["slices"] / g, 1) == 57.3 and round(bf16["device"] / g, 1) == 68.8
    assert round(bf16["host"] / g, 1) == 98.3
    assert round(layer_gathered(Config(QWEN3_32B, 8, 4096, "nccl", "layer", 2))["device"] / g, 1) == 64.7
    assert round(layer_gathered(Config(QWEN3_32B, 8, 12288, "nccl", "layer", 2))["device"] / g, 1) == 72.9
    assert round(layer_gathered(Config(QWEN3_32B, 8, 8192, "nccl", "layer", 4))["device"] / g, 1) == 88.4
    assert round(sharded_compute(Config(QWEN3_32B, 8, 8192, "nccl", "layer", 2))["peak"] / g, 1) == 69.5


def _tree(shift: int):
    from cells.rl.objectives.tree import RolloutTree, serialize_tree

    tree = RolloutTree()
    root = tree.add_node([1 + shift, 2, 3])
    a = tree.add_node([4, 5 + shift], root, loss_mask=True)
    b = tree.add_node([6], root, loss_mask=True)
    c = tree.add_node([7, 8], a, loss_mask=[True, False])
    d = tree.add_node([9 + shift, 10], a, loss_mask=True)
    return serialize_tree(tree, [b, c, d])


def _tree_rank(rank: int, store, w0, sers) -> tuple[torch.Tensor, torch.Tensor]:
    from cells.rl.layer_forward import tree_logprobs

    pg = ProcessGroupGloo(PrefixStore("tree", store), rank, S, timedelta(seconds=60))
    lay = FlatLayout({k: v.shape for k, v in w0.items()}, S, rank)
    lg = LayerGather(SPEC, lay, pg, timeout_s=60)
    src = Source(_flat(w0, lay)[rank * lay.shard_len: (rank + 1) * lay.shard_len].clone())
    lp = tree_logprobs(lg, src, sers[rank], sers[rank].token_ids, grad=True)
    (lp * torch.linspace(0.5, 1.5, len(lp))).sum().backward()
    return lp.detach(), src.grad


@pytest.mark.timeout(120)
def test_a_tree_forward_on_gathered_layers_equals_the_one_process_tree_forward():
    from cells.rl.trees import tree_token_logprobs

    w0, sers = init_weights(SPEC, 0, 0.02), [_tree(0), _tree(20)]
    params = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    want = []
    for ser in sers:
        want.append(tree_token_logprobs(prepare(SPEC, params), ser, ser.token_ids, 1.0, None))
        (want[-1] * torch.linspace(0.5, 1.5, len(want[-1]))).sum().backward()
    store = HashStore()
    with ThreadPoolExecutor(S) as ex:
        got = [f.result(timeout=120) for f in [ex.submit(_tree_rank, r, store, w0, sers) for r in range(S)]]
    lay = FlatLayout({k: v.shape for k, v in w0.items()}, S, 0)
    full = _flat({k: p.grad for k, p in params.items()}, lay)
    grad = torch.cat([g for _, g in got])
    assert all(torch.allclose(lp, w.detach(), atol=1e-5) for (lp, _), w in zip(got, want, strict=True))
    assert float((grad - full).norm()) <= 1e-4 * float(full.norm())
    # negative control: rank 0's slice of its own tree's gradient only, nothing reduced from rank 1
    half = torch.cat([got[0][1], torch.zeros_like(got[1][1])])
    assert float((half - full).norm()) > 1e-2 * float(full.norm())


def test_entropy_of_a_detached_packed_forward_is_the_models():
    w0 = init_weights(SPEC, 0, 0.02)
    lay = FlatLayout({k: v.shape for k, v in w0.items()}, 1, 0)
    lg, ids = LayerGather(SPEC, lay, None), torch.tensor([3, 7, 11, 2, 40, 5])
    want_ent: list = []
    want = token_logprobs(prepare(SPEC, w0), ids, entropy=want_ent)
    ent: list = []
    (lp,) = packed_logprobs(lg, Source(_flat(w0, lay)), [ids], grad=False, entropy=ent)
    assert torch.allclose(lp[1:], want, atol=1e-6) and torch.allclose(ent[0][1:], want_ent[0], atol=1e-6)
    assert float(ent[0][1:].min()) > 0  # a real entropy, not the zeros of the layout
    with pytest.raises(ValueError, match="detached"):
        packed_logprobs(lg, Source(_flat(w0, lay)), [ids], grad=True, entropy=[])

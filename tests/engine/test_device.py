"""`engine.device` and `engine.dtype` on CPU: every tensor of the engine where configured, bf16
through the same code, batch-invariant decode and scoring bitwise equal in bf16 too."""

import pytest
import torch
from pydantic import ValidationError

from cells.engine.embedded.device import misplaced, pool_blocks, resolve_device, resolve_dtype
from cells.engine.embedded.model import init_weights
from cells.engine.records import EngineError
from scheduler.contract.config.engine import EmbeddedEngineConfig

from .enginekit import make_engine, params, prompts, run_all


def test_config_refuses_unknown_devices_and_dtypes():
    for bad in ("gpu", "cuda:x", "tpu", ""):
        with pytest.raises(ValidationError):
            EmbeddedEngineConfig(device=bad)
    with pytest.raises(ValidationError):
        EmbeddedEngineConfig(dtype="float16")
    assert EmbeddedEngineConfig().device == "cpu" and EmbeddedEngineConfig().dtype == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(EngineError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(EngineError, match="CUDA is not available"):
        make_engine(device="cuda:0")


def test_dtype_names_and_cpu_pool_default():
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(EngineError):
        resolve_dtype(torch.float16)
    assert pool_blocks(None, torch.device("cpu"), 1 << 20, 0.5) == 2048  # the CPU default as it was
    assert pool_blocks(7, torch.device("cpu"), 1 << 20, 0.5) == 7


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_engine_tensor_is_on_the_device_in_the_dtype(dtype):
    eng = make_engine(True, dtype=dtype, num_blocks=32)
    eng.add_request("r", prompts(1)[0], params(0, max_tokens=4))
    run_all(eng)
    assert misplaced(eng, torch.device("cpu")) == []
    want = getattr(torch, dtype)
    assert eng.pool.k.dtype == want and all(t.dtype == want for t in eng.weights().values())
    # negative control: the check sees a tensor elsewhere
    eng.pool.k = eng.pool.k.to("meta")
    assert misplaced(eng, torch.device("cpu")) == ["kv.k@meta"]


def test_random_weights_are_made_in_the_dtype_and_match_float32_ones():
    from cells.engine.embedded.model_spec import PRESETS

    w32 = init_weights(PRESETS["toy"], 3)
    w16 = init_weights(PRESETS["toy"], 3, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in w16.values())
    assert all(torch.equal(w16[k], w32[k].to(torch.bfloat16)) for k in w32)


def test_loaded_versions_are_cast_to_the_engine_dtype():
    eng = make_engine(True, dtype="bfloat16", num_blocks=16)
    w = {k: v.float() for k, v in eng.weights().items()}
    eng.load_weights(1, w, keep_previous=True)
    assert all(t.dtype == torch.bfloat16 for t in eng.weights(1).values())
    assert misplaced(eng, torch.device("cpu")) == []


def _mixed_decode(eng, n: int):
    """`n` requests arriving two by two, so prefill chunks and decode steps share batches."""
    ps = prompts(n, seed=40 + n, lo=20, hi=70)
    out: dict[str, list] = {}
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params(i, max_tokens=8))
        if i % 2:
            for ev in eng.step():
                out.setdefault(ev.request_id, []).append(ev)
    for rid, evs in run_all(eng).items():
        out.setdefault(rid, []).extend(evs)
    return ps, out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bf16_batch_invariant_decode_equals_scoring_and_batch_one(dtype):
    eng = make_engine(True, dtype=dtype, prefill_chunk=24)
    ps, out = _mixed_decode(eng, 6)
    alone = make_engine(True, dtype=dtype, prefill_chunk=24)
    alone.add_request("r3", ps[3], params(3, max_tokens=8))
    solo = [e.record.logprob for e in run_all(alone)["r3"]]
    assert solo == [e.record.logprob for e in out["r3"]]
    for i, p in enumerate(ps):
        evs = out[f"r{i}"]
        got = torch.tensor([e.record.logprob for e in evs])
        scored = eng.score(p + [e.record.token_id for e in evs])[len(p) - 1 :].cpu()
        assert torch.equal(got, scored), (i, (got - scored).abs().max())
    # negative control: scoring under other weights does not match
    eng.load_weights(9, {k: v * 1.01 for k, v in eng.weights().items()}, keep_previous=True)
    evs = out["r0"]
    other = eng.score(ps[0] + [e.record.token_id for e in evs], version=9)[len(ps[0]) - 1 :]
    assert not torch.equal(torch.tensor([e.record.logprob for e in evs]), other)


def test_padded_row_reduction_gives_the_rows_own_values():
    from cells.engine.embedded.layers import MIN_REDUCE_ROWS, mean_sq

    x = torch.randn(3, 5, 64)  # fewer rows than MIN_REDUCE_ROWS: padded with zero rows, then cut
    got = mean_sq(x, pad_rows=True)
    assert got.shape == (3, 5, 1) and torch.allclose(got, x.pow(2).mean(-1, keepdim=True))
    big = torch.randn(MIN_REDUCE_ROWS + 2, 64)
    assert torch.equal(mean_sq(big, pad_rows=True), big.pow(2).mean(-1, keepdim=True))


def test_the_attention_batch_probe_runs_and_accepts_cpu_bmm():
    from cells.engine.embedded.layers import probe_bmm_batch

    assert probe_bmm_batch(8, 16, 64, (2, 7), torch.device("cpu"), torch.float32)


def test_cuda_means_the_cells_local_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 1)  # LOCAL_RANK modulo the GPUs it sees
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("cuda") == torch.device("cuda", 0)  # else the current device
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(EngineError, match="sees 2 GPU"):
        resolve_device("cuda:5")

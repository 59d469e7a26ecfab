"""The embedded engine on one CUDA device (marked `gpu`; skipped, and counted as skipped,
without CUDA). Small models, seconds each; the full-size check is bench/gpu_check.py
(docs/GPU.md section 11)."""

from __future__ import annotations

import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.device import misplaced
from cells.engine.records import SamplingParams
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL = ModelConfig(preset="tiny", vocab_size=4096, hidden_size=256, num_layers=2, head_dim=64,
                    intermediate_size=512, output_id_ranges=[(0, 4000)])


def _engine(**kw) -> EmbeddedEngine:
    return EmbeddedEngine(EmbeddedEngineConfig(model=MODEL, device="cuda", dtype="bfloat16", num_blocks=256,
                                               block_size=16, **kw))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(eng) -> dict:
    out: dict = {}
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


def test_every_tensor_is_on_the_gpu_and_decoding_works():
    eng = _engine()
    for i in range(3):
        eng.add_request(f"r{i}", _prompt(30 + i, i), SamplingParams(max_tokens=8, seed=i))
    out = _drain(eng)
    assert misplaced(eng, eng.device) == [] and eng.device.type == "cuda"
    assert all(len(v) == 8 and all(e.record.logprob <= 0 for e in v) for v in out.values())


def test_unset_num_blocks_sizes_the_pool_from_free_memory():
    eng = EmbeddedEngine(EmbeddedEngineConfig(model=MODEL, device="cuda", dtype="bfloat16", kv_memory_fraction=0.05))
    free, _ = torch.cuda.mem_get_info(eng.device)
    pool = eng.pool.num_blocks * eng.pool.bytes_per_block()
    before = free + pool  # free memory when the pool was sized (nothing else allocated since)
    assert eng.pool.num_blocks > 0 and 0.8 * 0.05 * before <= pool <= 1.01 * 0.05 * before


def test_batch_invariant_decode_equals_scoring_bitwise_with_prefill_mixed():
    eng = _engine(batch_invariant=True, prefill_chunk=32)
    prompts = [_prompt(20 + 13 * i, 10 + i) for i in range(8)]
    out: dict = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, seed=i))
        if i % 2:
            for ev in eng.step():
                out.setdefault(ev.request_id, []).append(ev)
    for k, v in _drain(eng).items():
        out.setdefault(k, []).extend(v)
    for i, p in enumerate(prompts):
        evs = out[f"r{i}"]
        got = torch.tensor([e.record.logprob for e in evs])
        scored = eng.score(p + [e.record.token_id for e in evs])[len(p) - 1:].float().cpu()
        assert torch.equal(got, scored), (i, (got - scored).abs().max())


def test_kv_export_is_a_host_copy_and_imports_back_bitwise():
    src, dst = _engine(), _engine()
    src.add_request("m", _prompt(70, 3), SamplingParams(max_tokens=4, seed=1))
    src.step()
    n = src.handover.num_kv_blocks("m")
    data = src.handover.export_kv("m", 0, n)
    assert data.device.type == "cpu" and data.is_pinned() and data.dtype == torch.bfloat16
    assert dst.handover.reserve("m", 80)
    dst.handover.import_kv("m", 0, data)
    for layer in range(src.spec.num_layers):
        k1, v1 = src.pool.read(layer, "m", 70)
        k2, v2 = dst.pool.read(layer, "m", 70)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)

"""Small engines and request sets for the engine tests."""

from __future__ import annotations

import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.records import SamplingParams
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

VOCAB = 1024


def make_engine(batch_invariant: bool = True, num_blocks: int = 256, block_size: int = 8, seed: int = 0,
                **engine_kw) -> EmbeddedEngine:
    model = ModelConfig(preset="tiny", vocab_size=VOCAB, hidden_size=128, num_layers=2, head_dim=32,
                        intermediate_size=256, output_id_ranges=[(0, 900), (1000, VOCAB)], seed=seed)
    cfg = EmbeddedEngineConfig(model=model, batch_invariant=batch_invariant, num_blocks=num_blocks,
                               block_size=block_size, **engine_kw)
    return EmbeddedEngine(cfg)


def prompts(n: int, seed: int = 0, lo: int = 10, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def run_all(engine: EmbeddedEngine, max_steps: int = 10_000) -> dict[str, list]:
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
    assert not engine.has_work(), "engine did not drain"
    return out


def params(i: int, greedy: bool = False, max_tokens: int = 16) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=100 + i)

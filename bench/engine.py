"""Embedded engine throughput: decode tokens/s at batch 1 and 16, prefill tokens/s at 2k context.

The baseline the other benches are read against. Fast mode (the default path), tiny preset.
"""

from __future__ import annotations

import torch  # noqa: E402
from common import Timer, finish, parse_args, set_threads

from cells.engine.embedded import EmbeddedEngine  # noqa: E402
from cells.engine.records import SamplingParams  # noqa: E402
from scheduler.contract.config import EmbeddedEngineConfig, ModelConfig  # noqa: E402


def decode_rate(eng: EmbeddedEngine, batch: int, context: int, new_tokens: int) -> float:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", torch.randint(0, 8000, (context,), generator=g).tolist(),
                        SamplingParams(max_tokens=new_tokens + 1, seed=i))
    while any(r.num_computed < len(r.token_ids) - 1 for r in eng.requests.values()):
        eng.step()  # prefill (and the first token) outside the timed part
    n = 0
    with Timer() as t:
        while eng.has_work():
            n += len(eng.step())
    return n / t.s


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    context = 2048
    new = 16 if args.quick else 64
    cfg = EmbeddedEngineConfig(model=ModelConfig(preset="tiny"), num_blocks=4096, max_running=16, prefill_chunk=4096)
    eng = EmbeddedEngine(cfg)
    params = sum(t.numel() for t in eng.weights().values())
    decode_rate(eng, 1, 128, 4)  # warm-up
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 8000, (context,), generator=g).tolist()
    reps = 1 if args.quick else 3
    best = float("inf")
    for r in range(reps):
        eng.add_request(f"p{r}", prompt, SamplingParams(max_tokens=1))
        with Timer() as t:
            while eng.has_work():
                eng.step()
        best = min(best, t.s)
    result = {
        "params": params,
        "vocab": eng.spec.vocab_size,
        "output_vocab": len(eng.spec.output_ids() or range(eng.spec.vocab_size)),
        "context_tokens": context,
        "decode_tokens_per_s": {str(b): round(decode_rate(eng, b, 512, new), 1) for b in (1, 16)},
        "prefill_tokens_per_s": round(context / best, 1),
    }
    finish(result, args, "engine")


if __name__ == "__main__":
    main()

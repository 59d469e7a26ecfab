"""Embedded engine throughput: decode tokens/s at batch 1 and 16, prefill tokens/s at 2k context.

The baseline the other benches are read against. Fast mode (the default path), tiny preset, on
`--device` (cpu) in `--dtype` (float32). Also bf16 against fp32 on the toy model (the same
weights, one cast to bf16): greedy-token agreement and the largest |Δ log-prob|, reported,
not asserted.
"""

from __future__ import annotations

import torch  # noqa: E402
from common import Timer, finish, parse_args, set_threads

from cells.engine.embedded import EmbeddedEngine  # noqa: E402
from cells.engine.records import SamplingParams  # noqa: E402
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig  # noqa: E402


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


def bf16_vs_fp32(device: str, n: int = 8, new_tokens: int = 32) -> dict:
    """Greedy decode of `n` prompts on the toy model in fp32 and in bf16 (its weights cast):
    the share of generated tokens on which both agree (each request up to where they first
    differ, after which the contexts differ too), and the largest |Δ log-prob| when both
    score the fp32 sequences (teacher-forced)."""
    engines = {}
    for dt in ("float32", "bfloat16"):
        cfg = EmbeddedEngineConfig(model=ModelConfig(preset="toy"), num_blocks=256, device=device, dtype=dt)
        engines[dt] = EmbeddedEngine(cfg, weights=engines["float32"].weights() if engines else None)
    outs: dict[str, list[list[int]]] = {}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 8000, (48,), generator=g).tolist() for _ in range(n)]
    for dt, eng in engines.items():
        for i, p in enumerate(prompts):
            eng.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=new_tokens))
        toks: dict[str, list[int]] = {}
        while eng.has_work():
            for ev in eng.step():
                toks.setdefault(ev.request_id, []).append(ev.record.token_id)
        outs[dt] = [toks[f"g{i}"] for i in range(n)]
    agree, delta = 0, 0.0
    for p, a, b in zip(prompts, outs["float32"], outs["bfloat16"]):
        agree += next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        lp = [engines[dt].score(p + a)[len(p) - 1:].float().cpu() for dt in engines]
        delta = max(delta, float((lp[0] - lp[1]).abs().max()))
    return {"greedy_token_agreement": round(agree / (n * new_tokens), 4), "max_abs_dlogprob": round(delta, 5),
            "requests": n, "new_tokens": new_tokens}


def main() -> None:
    args = parse_args(__doc__, extra=lambda ap: (
        ap.add_argument("--device", default="cpu", help="engine.device: cpu, cuda, cuda:N"),
        ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine.dtype")))
    set_threads(1)
    context = 2048
    new = 16 if args.quick else 64
    cfg = EmbeddedEngineConfig(model=ModelConfig(preset="tiny"), num_blocks=4096, max_running=16, prefill_chunk=4096,
                               device=args.device, dtype=args.dtype)
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
        "device": str(eng.device),
        "dtype": args.dtype,
        "bf16_vs_fp32_toy": bf16_vs_fp32(args.device),
    }
    finish(result, args, "engine")


if __name__ == "__main__":
    main()

"""On-policy numerics: decode-time log-probs vs cache-free scoring of the same sequences.

At least 16 seeded requests with prompts of at least 512 tokens, decoded at batch sizes 1, 2, 3
and 8 (max_running = the batch size, so prefills mix with decodes as requests finish), in the
fast mode (the default path, no invariance measures) and the batch-invariant mode.
slowdown = the largest, over batch sizes, of batch-invariant decode time / fast decode time.
"""

from __future__ import annotations

import os

import torch  # noqa: E402
from common import Timer, finish, parse_args, set_threads

from cells.engine.embedded import EmbeddedEngine  # noqa: E402
from cells.engine.records import SamplingParams  # noqa: E402
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig  # noqa: E402

BATCH_SIZES = (1, 2, 3, 8)


def run(batch_invariant: bool, batch: int, prompts, new_tokens: int, weights):
    cfg = EmbeddedEngineConfig(model=ModelConfig(preset="tiny"), batch_invariant=batch_invariant,
                               num_blocks=1024, max_running=batch, prefill_chunk=512,
                               row_tile=int(os.environ.get("CELLFLIP_ROW_TILE", "4")))
    eng = EmbeddedEngine(cfg, weights=weights)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, SamplingParams(max_tokens=new_tokens, seed=i))
    out: dict[str, list] = {}
    with Timer() as t:
        while eng.has_work():
            for ev in eng.step():
                out.setdefault(ev.request_id, []).append(ev.record)
    diffs, equal, n = [], 0, 0
    for i, p in enumerate(prompts):
        recs = out[f"q{i}"]
        sampled = torch.tensor([r.logprob for r in recs])
        scored = eng.score(p + [r.token_id for r in recs])[len(p) - 1 :].float()
        diffs.append((sampled - scored).abs().max().item())
        equal += int((sampled == scored).sum())
        n += len(recs)
    return t.s, equal, n, max(diffs)


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    n_req, plen, new = (16, 512, 8) if args.quick else (16, 640, 24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8000, (plen + int(torch.randint(0, 64, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_req)]
    weights = EmbeddedEngine(EmbeddedEngineConfig(model=ModelConfig(preset="tiny"), num_blocks=16)).weights()
    res = {True: {"eq": 0, "n": 0, "diff": 0.0}, False: {"eq": 0, "n": 0, "diff": 0.0}}
    slowdown = 0.0
    per_batch = {}
    for b in BATCH_SIZES:
        times = {}
        for mode in (False, True):
            times[mode], eq, n, d = run(mode, b, prompts, new, weights)
            res[mode]["eq"] += eq
            res[mode]["n"] += n
            res[mode]["diff"] = max(res[mode]["diff"], d)
        t_fast, t_bi = times[False], times[True]
        per_batch[str(b)] = {"fast_s": round(t_fast, 3), "batch_invariant_s": round(t_bi, 3)}
        slowdown = max(slowdown, t_bi / t_fast)
    mode = lambda r: {"bitwise_equal_frac": round(r["eq"] / r["n"], 6), "max_abs_diff": r["diff"]}
    finish({
        "requests": n_req,
        "prompt_tokens": plen,
        "batch_sizes": list(BATCH_SIZES),
        "fast": mode(res[False]),
        "batch_invariant": mode(res[True]),
        "slowdown": round(slowdown, 3),
        "per_batch": per_batch,
    }, args, "onpolicy")


if __name__ == "__main__":
    main()

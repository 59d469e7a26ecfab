"""The parts of bench/gpu_check.py, each a function of (device, sizes, work folder) returning
a JSON-able dict with `ok`. The same code runs on CPU with `--tiny` sizes (the CPU suite's
check that every part's path works) and on a GPU with the full ones."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.records import SamplingParams
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

# A Qwen3-1.7B-shaped model (tied embeddings, full Qwen3 vocabulary): 1.72 B parameters.
FULL_MODEL = {"preset": "qwen3-vocab", "hidden_size": 2048, "num_layers": 28, "num_heads": 16,
              "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 6144, "max_position": 8192}
TINY_MODEL = {"preset": "tiny", "vocab_size": 1024, "hidden_size": 128, "num_layers": 2, "head_dim": 32,
              "intermediate_size": 256, "output_id_ranges": [[0, 900], [1000, 1024]], "max_position": 4096}


def sizes(tiny: bool) -> dict:
    """Everything a part's size depends on."""
    if tiny:
        return {"model": TINY_MODEL, "prompt_vocab": 900, "decode_tokens": 8, "batches_c": (1, 3, 8, 64),
                "tokens_c": 4, "context_f": 64, "new_f": 4, "batches_f": (1, 16, 64), "block_size": 8,
                "bucket_bytes": 1 << 16, "copy_bytes": 1 << 24}
    return {"model": FULL_MODEL, "prompt_vocab": 150000, "decode_tokens": 32, "batches_c": (1, 3, 8, 64),
            "tokens_c": 6, "context_f": 1024, "new_f": 16, "batches_f": (1, 16, 64), "block_size": 16,
            "bucket_bytes": 64 << 20, "copy_bytes": 4 << 30}


def engine_cfg(device: str, size: dict, **kw) -> EmbeddedEngineConfig:
    base = {"model": ModelConfig(**size["model"]), "device": device, "dtype": "bfloat16",
            "block_size": size["block_size"], "max_running": 64}
    return EmbeddedEngineConfig(**{**base, **kw})


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prompt(size: dict, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, size["prompt_vocab"], (n,), generator=g).tolist()


def drain(eng: EmbeddedEngine) -> dict[str, list]:
    out: dict[str, list] = {}
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


# -- (a) a >= 1.5 B Qwen3-architecture model decodes in bf16 --------------------------------
def part_a(device: str, size: dict, work: Path) -> dict:
    t0 = time.perf_counter()
    eng = EmbeddedEngine(engine_cfg(device, size, num_blocks=512))
    sync(device)
    build_s = time.perf_counter() - t0
    params = sum(t.numel() for t in eng.weights().values())
    for i in range(4):
        eng.add_request(f"a{i}", prompt(size, 100 + 10 * i, i), SamplingParams(max_tokens=size["decode_tokens"], seed=i))
    t1 = time.perf_counter()
    out = drain(eng)
    sync(device)
    lps = [e.record.logprob for evs in out.values() for e in evs]
    from cells.engine.embedded.device import misplaced

    return {"ok": len(lps) == 4 * size["decode_tokens"] and all(lp == lp and lp <= 0 for lp in lps)
            and not misplaced(eng, eng.device),
            "params": params, "dtype": str(eng.dtype), "device": str(eng.device), "build_s": round(build_s, 2),
            "decode_s": round(time.perf_counter() - t1, 2), "tokens": len(lps), "kv_blocks": eng.pool.num_blocks,
            "weights_gib": round(sum(t.numel() * t.element_size() for t in eng.weights().values()) / 2**30, 2)}


# -- (b) a live request moves between two cell processes ------------------------------------
def part_b(device: str, size: dict, work: Path) -> dict:
    import gpu_migrate

    args = {"engine": {"model": size["model"], "batch_invariant": True, "num_blocks": 256,
                       "block_size": size["block_size"], "device": device, "dtype": "bfloat16"},
            "prompt": prompt(size, 150, 99), "max_tokens": 24, "seed": 5, "steps_before": 4, "load": 3,
            "pace_s": 0.02}
    res = gpu_migrate.run_pair(args, work, timeout_s=240)
    res["nccl"] = ("not tested: NCCL refuses two ranks on one device, so the cross-GPU path needs two GPUs; "
                   "on one GPU both cells use the host-staged gloo path")
    return res


# -- (c) batch-invariant bitwise at batch 1, 3, 8, 64, prefill and decode mixed ---------------
def _run_batch(eng: EmbeddedEngine, size: dict, batch: int) -> tuple[dict, list]:
    """`batch` requests, a third queued at first and the rest added two by two between steps
    (so prefill chunks share batches with decode steps). r0 is the same request every time."""
    reqs = [(f"r{i}", prompt(size, 40 + (37 * i) % 120, 1000 + i)) for i in range(batch)]
    out: dict[str, list] = {}
    first = max(1, batch // 3)
    for rid, p in reqs[:first]:
        eng.add_request(rid, p, SamplingParams(max_tokens=size["tokens_c"], seed=int(rid[1:])))
    rest = reqs[first:]
    while rest or eng.has_work():
        for rid, p in rest[:2]:
            eng.add_request(rid, p, SamplingParams(max_tokens=size["tokens_c"], seed=int(rid[1:])))
        rest = rest[2:]
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out, reqs


def part_c(device: str, size: dict, work: Path) -> dict:
    eng = EmbeddedEngine(engine_cfg(device, size, num_blocks=2048, batch_invariant=True, prefill_chunk=256))
    r0: dict[int, list[float]] = {}
    mismatches, checked = 0, 0
    for batch in size["batches_c"]:
        out, reqs = _run_batch(eng, size, batch)
        r0[batch] = [e.record.logprob for e in out["r0"]]
        for rid, p in reqs:
            evs = out[rid]
            got = torch.tensor([e.record.logprob for e in evs])
            scored = eng.score(p + [e.record.token_id for e in evs])[len(p) - 1:].float().cpu()
            mismatches += int((got != scored).sum())
            checked += len(evs)
    same_r0 = all(v == r0[1] for v in r0.values())
    # negative control: scoring r0 under other weights must not match its sampled log-probs
    eng.load_weights(1, {k: v * 1.01 for k, v in eng.weights().items()}, keep_previous=True)
    out, reqs = _run_batch(eng, size, 1)
    p0, evs = reqs[0][1], out["r0"]
    other = eng.score(p0 + [e.record.token_id for e in evs], version=0)[len(p0) - 1:].float().cpu()
    caught = not torch.equal(torch.tensor([e.record.logprob for e in evs]), other)
    return {"ok": mismatches == 0 and same_r0 and caught, "bitwise_decode_vs_scoring": mismatches == 0,
            "tokens_checked": checked, "mismatches": mismatches, "r0_same_at_every_batch": same_r0,
            "batches": list(size["batches_c"]), "row_tile": eng.tile, "negative_control_caught": caught}


# -- (d) a version received into device buffers, checksum on the host staging copy -----------
def new_version(weights: dict) -> dict:
    """Version 1: every weight scaled by 1.01 (made alike in both processes)."""
    return {k: (v.float() * 1.01).to(v.dtype) for k, v in weights.items()}


def _transfer(engine: dict, stagings: list[dict], bucket_bytes: int, work: Path) -> tuple[list, float]:
    """A sender process (the same engine config, so the same weights) sends version 1's
    tensors named in each of `stagings` in turn over one gloo pair channel; each is received
    here into its staging tensors (device buffers) through host wire buffers. The second
    transfer has one byte of its first bucket flipped on arrival (the negative control).
    Returns each transfer's error (None: received and verified) and the first one's seconds."""
    import gpu_migrate

    from cells.transport.catchup import recv_version_p2p
    from cells.transport.p2p import PairChannel
    from cells.transport.store import StoreHost

    host = StoreHost("127.0.0.1", 0, timeout_s=60)
    name = f"w{time.monotonic_ns()}"
    child = gpu_migrate.spawn({"role": "send_version", "engine": engine, "port": host.address.port, "name": name,
                               "bucket_bytes": bucket_bytes, "names": [sorted(st) for st in stagings]}, work)
    errs: list = []
    first_s = 0.0

    def flip(i: int, wire: torch.Tensor) -> None:
        if i == 0:
            wire[0] ^= 1

    try:
        with PairChannel(host.store, name, 1, timeout_s=120, connect_timeout_s=120) as ch:
            for n, staging in enumerate(stagings):
                t = time.perf_counter()
                try:
                    recv_version_p2p(ch, staging=staging, bucket_hook=flip if n == 1 else None)
                    errs.append(None)
                except Exception as e:  # noqa: BLE001 - reported
                    errs.append(f"{type(e).__name__}: {e}")
                sync(str(next(iter(staging.values())).device))
                first_s = first_s or time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - the channel itself failed
        errs += [f"{type(e).__name__}: {e}"] * (len(stagings) - len(errs))
    finally:
        try:
            child.wait(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        host.close()
    return errs, first_s


def part_d(device: str, size: dict, work: Path) -> dict:
    from cells.training.wire import weights_checksum

    cfg = engine_cfg(device, size, num_blocks=256, batch_invariant=True)
    eng = EmbeddedEngine(cfg)
    new = new_version(eng.weights())  # what the sender process sends, made here to compare
    staging = {k: torch.empty_like(v) for k, v in new.items()}  # the device buffers it lands in
    few = dict(list(new.items())[:3])  # the negative control: a flipped byte must be refused
    (err, bad), transfer_s = _transfer(cfg.model_dump(mode="json"),
                                       [staging, {k: torch.empty_like(v) for k, v in few.items()}],
                                       size["bucket_bytes"], work)
    same = err is None and all(torch.equal(staging[k], new[k]) for k in new)
    crc_ok = err is None and weights_checksum({k: v.cpu() for k, v in staging.items()}) == weights_checksum(
        {k: v.cpu() for k, v in new.items()})
    eng.install_prepared(1, eng.prepare_weights(staging))
    p = prompt(size, 80, 7)
    eng.add_request("d", p, SamplingParams(max_tokens=8, seed=3))
    evs = drain(eng)["d"]
    got = torch.tensor([e.record.logprob for e in evs])
    scored = eng.score(p + [e.record.token_id for e in evs], version=1)[len(p) - 1:].float().cpu()
    on_v1 = all(e.record.version == 1 for e in evs) and torch.equal(got, scored)
    caught = bad is not None and "checksum" in bad.lower()
    return {"ok": same and crc_ok and on_v1 and caught, "checksum_verified": err is None, "error": err,
            "staging_equals_sent": same, "weights_checksum_equal": crc_ok, "decodes_on_new_version": on_v1,
            "transfer_s": round(transfer_s, 2), "bytes": sum(t.numel() * t.element_size() for t in new.values()),
            "path": "buckets over gloo, CRC32 on the host wire buffers, copied into device buffers",
            "negative_control_caught": caught, "negative_control_error": bad}


# -- (e) one training step on the device ----------------------------------------------------
def part_e(device: str, size: dict, work: Path) -> dict:
    return {"ok": None, "ran": False,
            "reason": "not run: the learner has no device yet (the sharded-training work gives it one)"}


# -- (f) decode tokens/s at batch 1, 16, 64 at a fixed context, with roofline_fraction ------
def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> float:
    """Device-to-device copy rate in bytes read per second (best of `reps`)."""
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _decode_steps(eng: EmbeddedEngine, size: dict, batch: int) -> tuple[float, int, int]:
    """(seconds, steps, tokens) of the decode steps of `batch` requests at the context."""
    ctx, new = size["context_f"], size["new_f"]
    for i in range(batch):
        eng.add_request(f"f{batch}-{i}", prompt(size, ctx, 5000 + i), SamplingParams(max_tokens=new + 1, seed=i))
    while any(r.num_computed < len(r.token_ids) - 1 or not r.records for r in eng.requests.values()):
        eng.step()  # prefill and the first token, untimed
    sync(eng.device)
    steps = tokens = 0
    t = time.perf_counter()
    while eng.has_work():
        tokens += len(eng.step())
        steps += 1
    sync(eng.device)
    return time.perf_counter() - t, steps, tokens


def part_f(device: str, size: dict, work: Path) -> dict:
    ctx, new, bs = size["context_f"], size["new_f"], size["block_size"]
    blocks = max(size["batches_f"]) * -(-(ctx + new + 2) // bs) + 16
    eng = EmbeddedEngine(engine_cfg(device, size, num_blocks=blocks, prefill_chunk=8192))
    bw = copy_bandwidth(device, size["copy_bytes"])
    wbytes = sum(t.numel() * t.element_size() for t in eng.weights().values())
    kv_token = eng.pool.bytes_per_block() // bs
    _decode_steps(eng, size, 1)  # warm-up
    rate, step_ms, frac = {}, {}, {}
    for b in size["batches_f"]:
        s, steps, tokens = _decode_steps(eng, size, b)
        step = s / max(steps, 1)
        read = wbytes + b * (ctx + new // 2) * kv_token  # weights plus the batch's KV, per step
        rate[str(b)], step_ms[str(b)] = round(tokens / s, 1), round(step * 1e3, 3)
        frac[str(b)] = round(read / step / bw, 4)
    return {"ok": True, "context": ctx, "decode_tokens_per_s": rate, "step_ms": step_ms, "roofline_fraction": frac,
            "copy_bandwidth_gb_s": round(bw / 1e9, 1), "weights_bytes": wbytes, "kv_bytes_per_token": kv_token,
            "mode": "fast (not batch-invariant), bf16",
            "cuda_graphs": "not used: never measured on a GPU, so not known to help"}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}

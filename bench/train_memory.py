"""bench/train.py's memory figures:

- logprob (in a fresh process, `python bench/train.py --logprob-probe`): extra memory of one forward and backward of the loss (sum of the sampled tokens'
  log-probs) at T = 8,192 over the full 151,936-row output: the `qwen3-vocab` preset (the
  bench's size, hidden 256, 4 layers) untied like Qwen3-32B, per-layer activation
  checkpointing on, fp32. Peak resident memory (glibc returning large blocks at once) minus
  the resident memory before the forward (weights built, one warm-up pass) minus the weights'
  gradients (`logprob_probe`).
- sharded (in this process: `sharded_figures`): 2 cells x 2 ranks (cells/training/shard_ranks.py)
  against one process, fp32 and bf16; each rank's live tensor bytes at rest, its peak resident
  memory over its baseline, and cells/rl/memory.py's formula at the same size.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

LOGPROB_T = 8192


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> int:
    """Free what can be freed, reset the peak to now; the resident bytes now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def logprob_probe(checkpoint: bool = True) -> dict:
    """Segments: the forward (nothing but activations is new), then the backward, where the
    output layer's gradient (created by the backward, then the weight's) is subtracted; the
    embedding's gradient exists before (zeros, in the baseline), so the dense gradient its
    backward adds counts as extra (an over-estimate)."""
    from cells.engine.embedded.model import init_weights, prepare, token_logprobs
    from cells.engine.embedded.model_spec import PRESETS

    torch.set_num_threads(1)
    spec = replace(PRESETS["qwen3-vocab"], tie_word_embeddings=False, max_position=LOGPROB_T)
    weights = {k: v.requires_grad_(True) for k, v in init_weights(spec, 0, 0.02).items()}
    ids = torch.randint(0, spec.vocab_size, (LOGPROB_T,), generator=torch.Generator().manual_seed(0))
    # warm-up (library code and workspaces are not the loss's memory)
    token_logprobs(prepare(spec, weights, checkpoint=checkpoint), ids[:256], 1.0, None).sum().backward()
    for k, w in weights.items():
        w.grad = torch.zeros_like(w) if k == "model.embed_tokens.weight" else None
    base = _settle()
    lp = token_logprobs(prepare(spec, weights, checkpoint=checkpoint), ids, 1.0, None)
    forward_peak = _status("VmHWM") - base
    lp.sum().backward()
    head = weights["lm_head.weight"].grad
    backward_peak = _status("VmHWM") - base - head.numel() * head.element_size()
    return {"logprob_peak_bytes": max(forward_peak, backward_peak), "forward_peak_bytes": forward_peak,
            "backward_peak_bytes": backward_peak, "tokens": LOGPROB_T, "vocab": spec.vocab_size,
            "checkpoint": checkpoint}


def run_probe(name: str) -> dict:
    """`python bench/train.py --<name>-probe` in a fresh process; its JSON."""
    # large blocks straight from and back to the kernel: resident memory follows the live bytes
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), f"--{name}-probe"],
                       capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"memory probe {name} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


SHARD_CFG = {"preset": "toy", "lr": 1e-3, "minibatches": 2, "updates": 3, "groups": 4, "shares": [1, 1, 2, 2],
             "kl_coef": 0.01, "timeout_s": 300}
"""2 cells x 2 ranks against one process: three updates, token shares 1:2 between the cells
(1:1 inside each), one tree per group, KL in the loss, self-normalisation on."""


def _rel_diff(a: dict, b: dict, w0: dict) -> float:
    out = 0.0
    for k in a:
        den = float((a[k] - w0[k]).norm())
        if den > 0:
            out = max(out, float((a[k] - b[k]).norm()) / den)
    return out


def _median_step(rank: dict) -> float:
    return round(statistics.median(s["step_s"] for s in rank["steps"][1:]), 3)


def sharded_figures(tmp: Path) -> dict:
    """The sharded ranks' figures (cells/training/shard_ranks.py) and the memory formula's error."""
    from safetensors.torch import load_file

    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS
    from cells.rl.memory import Config, built
    from cells.training.shard_ranks import launch

    runs, theta = {}, {}
    for prec in ("fp32", "bf16"):
        cfg = {**SHARD_CFG, "precision": prec}
        runs[f"one_{prec}"] = launch(0, 0, cfg, tmp / f"one_{prec}")
        runs[f"shard_{prec}"] = launch(2, 2, cfg, tmp / f"shard_{prec}")
    runs["one_fp32_per_sequence"] = launch(0, 0, {**SHARD_CFG, "pack": False}, tmp / "one_fp32_per_sequence")
    for prec in ("fp32", "bf16"):
        runs[f"gathered_{prec}"] = launch(2, 2, {**SHARD_CFG, "gather_layers": True, "precision": prec},
                                          tmp / f"gathered_{prec}")
    for k in runs:
        theta[k] = load_file(str(tmp / k / "params.safetensors"))
    w0 = init_weights(PRESETS["toy"], 0, 0.02)
    ranks = runs["shard_fp32"]
    params = ranks[0]["params"]
    extra = max(r["rank_peak_rss_bytes"] - r["base_rss_bytes"] for r in ranks)
    tokens = max(r["graph_tokens"] for r in ranks)
    formula = built(Config(PRESETS["toy"], 2, tokens))
    return {
        "ranks_per_cell": 2, "shard_cells": 2, "shard_params": params,
        "sharded_param_max_rel_diff": _rel_diff(theta["one_fp32"], theta["shard_fp32"], w0),
        "bf16_param_max_rel_diff": _rel_diff(theta["one_bf16"], theta["shard_bf16"], w0),
        "bf16_vs_fp32_rel_diff": _rel_diff(theta["one_fp32"], theta["one_bf16"], w0),
        "state_bytes_per_param": 40,
        "rank_state_bytes": max(r["rank_state_bytes"] for r in ranks),
        "one_process_state_bytes": runs["one_fp32"][0]["rank_state_bytes"],
        "rank_state_budget_bytes": 1.25 * 40 * params / 2,
        "rank_peak_rss_bytes": max(r["rank_peak_rss_bytes"] for r in ranks),
        "rank_peak_extra_bytes": extra,
        "memory_formula_bytes": formula["peak"], "memory_formula_terms": formula, "graph_tokens": tokens,
        "memory_formula_error": round(abs(formula["peak"] - extra) / extra, 4),
        "shard_trees": ranks[0]["steps"][0]["num_trees"],
        "shard_step_s": {"one": _median_step(runs["one_fp32"][0]), "2x2": _median_step(ranks[0])},
        # several sequences per forward: the one-process update packed (the default) and not
        "pack_step_s": {"packed": _median_step(runs["one_fp32"][0]),
                        "per_sequence": _median_step(runs["one_fp32_per_sequence"][0])},
        "pack_rel_diff": _rel_diff(theta["one_fp32"], theta["one_fp32_per_sequence"], w0),
        **_gathered_figures(runs, theta, w0),
    }


def _gathered_figures(runs: dict, theta: dict, w0: dict) -> dict:
    """The 2 x 2 run with the compute weights gathered a layer at a time (GatheredLearner):
    its distance to one process, a rank's state and peak, `memory.layer_gathered` at its size
    (device and host terms together: one process's memory on CPU); the same in bf16 (its
    gradient slice bf16) against one process in bf16."""
    from cells.engine.embedded.model_spec import PRESETS
    from cells.rl.memory import Config, layer_gathered

    ranks = runs["gathered_fp32"]
    extra = max(r["rank_peak_rss_bytes"] - r["base_rss_bytes"] for r in ranks)
    f = layer_gathered(Config(PRESETS["toy"], 2, max(r["graph_tokens"] for r in ranks)))
    total = f["device"] + f["host"]
    state = max(r["rank_state_bytes"] for r in ranks)
    return {"gathered_param_max_rel_diff": _rel_diff(theta["one_fp32"], theta["gathered_fp32"], w0),
            "gathered_bf16_param_max_rel_diff": _rel_diff(theta["one_bf16"], theta["gathered_bf16"], w0),
            "gathered_rank_state_bytes": state, "gathered_state_bytes_per_param": round(state / ranks[0]["params"], 2),
            "gathered_rank_peak_extra_bytes": extra, "gathered_memory_formula_bytes": total,
            "gathered_memory_formula_error": round(abs(total - extra) / extra, 4),
            "gathered_step_s": _median_step(ranks[0])}

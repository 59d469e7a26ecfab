"""Hugging Face checkpoint directories: config.json + safetensors (Qwen3 and Llama layouts).

Loads local files only; nothing is downloaded. Tensor names are the model's own (the engine
keeps Hugging Face names), so a checkpoint maps one to one; extra tensors a checkpoint may
carry (e.g. rotary caches) are ignored, missing ones are an error.

Loading reads one tensor at a time (`safe_open`) and converts it to the target dtype and device
at once: the host never holds the whole model in fp32 besides what it loads into (at
Qwen3-32B in bf16: 65.6 GB, against 131 GB for an fp32 staging copy). A sharded directory is
read through its `model.safetensors.index.json`; a shard the index names that is missing, or a
tensor no shard holds, is a clear error.

Writing (`save_checkpoint`) produces what Hugging Face tools read: shards of at most
`max_shard_bytes` named `model-0000k-of-0000n.safetensors`, `model.safetensors.index.json`,
`config.json`, and the tokenizer and generation-config files copied from `source` when it has
them. A model whose sampling is restricted to some output ids (the toy models) cannot say so in
a Hugging Face config: the ranges go under the config's `cellflip` key
(`{"output_id_ranges": [[lo, hi], ...], "version": v}`), which this loader reads back (so an
export serves bitwise like the cells that served its version) and other tools ignore — with
them such an export samples from the whole vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cells.engine.embedded.model import check_weights
from cells.engine.embedded.model_spec import ModelSpec
from cells.engine.records import EngineError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX = "model.safetensors.index.json"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json")
"""Files copied from a source checkpoint into an export when it has them."""
MAX_SHARD_BYTES = 5 << 30


def _shards(root: Path) -> dict[str, list[str] | None]:
    """shard file → the tensor names to take from it (None: all), from the index when present."""
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise EngineError(f"cannot read {index}: {e}") from None
        out: dict[str, list[str] | None] = {}
        for name, shard in weight_map.items():
            out.setdefault(shard, []).append(name)
        missing = [s for s in out if not (root / s).is_file()]
        if missing:
            raise EngineError(f"{index} names shards that are not in {root}: {missing[:3]}")
        return out
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {root}")
    return dict.fromkeys(files)


def load_checkpoint(path: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The model's tensors from a Hugging Face directory, each converted to `dtype` on `device`
    as it is read."""
    root = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in _shards(root).items():
        with safe_open(str(root / shard), framework="pt", device="cpu") as f:
            for name in names if names is not None else f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (spec.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    check_weights(spec, tensors)
    return tensors


def _config(spec: ModelSpec, dtype: torch.dtype, version: int | None) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if spec.qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if spec.qk_norm else "llama",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    ours = {}
    if spec.output_id_ranges:
        ours["output_id_ranges"] = [list(r) for r in spec.output_id_ranges]
    if version is not None:
        ours["version"] = version
    if ours:
        cfg["cellflip"] = ours
    return cfg


def save_checkpoint(path: str | Path, spec: ModelSpec, weights: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                    source: str | Path | None = None, version: int | None = None) -> Path:
    """Write a Hugging Face directory that `load_checkpoint` and HF tools read (see the module
    notes); written beside `path` and renamed into place, so a crash leaves no half export.
    Returns `path`."""
    check_weights(spec, weights)
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise EngineError(f"{root} exists and is not an empty directory: an export never overwrites")
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    size = 0
    elem = torch.empty((), dtype=dtype).element_size()
    for name in sorted(weights):
        n = weights[name].numel() * elem
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map, total = {}, 0
    for k, names in enumerate(groups, 1):
        shard = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        part = {n: weights[n].detach().to(device="cpu", dtype=dtype).contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in part.values())
        save_file(part, str(tmp / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(_config(spec, dtype, version), indent=2))
    if source is not None:
        for name in SIDE_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, tmp / name)
    if root.exists():
        root.rmdir()  # empty (checked above)
    os.replace(tmp, root)
    return root


__all__ = ["load_checkpoint", "save_checkpoint"]

"""Hugging Face checkpoint directories: config.json + *.safetensors (Qwen3 and Llama layouts).

Loads local files only; nothing is downloaded. Tensor names are the model's own (the engine
keeps Hugging Face names), so a checkpoint maps one to one; extra tensors a checkpoint may
carry (e.g. rotary caches) are ignored, missing ones are an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cells.engine.embedded.model import check_weights
from cells.engine.embedded.model_spec import ModelSpec
from cells.engine.records import EngineError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_checkpoint(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {root}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    if spec.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v.to(torch.float32) for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    check_weights(spec, tensors)
    return tensors


def save_checkpoint(path: str | Path, spec: ModelSpec, weights: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32) -> None:
    """Write a Hugging Face-style directory that `load_checkpoint` (and HF tools) can read."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
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
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.detach().to(dtype).contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))


__all__ = ["load_checkpoint", "save_checkpoint"]

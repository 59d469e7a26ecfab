"""Model shapes: presets, the config-to-spec resolution, and Hugging Face config.json mapping."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cells.engine.records import EngineError
from scheduler.contract.config.engine import ModelConfig

# Qwen3's tokenizer: 151,643 BPE ranks, then the added special tokens up to <think>/</think>;
# Qwen3 checkpoints pad the embedding to 151,936 rows.
QWEN3_VOCAB = 151936
QWEN3_SPECIAL_FIRST, QWEN3_SPECIAL_END = 151643, 151669


@dataclass(frozen=True)
class ModelSpec:
    """Everything that fixes the model's tensor shapes and numerics."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 40960
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    output_id_ranges: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise EngineError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise EngineError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for lo, hi in self.output_id_ranges or ():
            if not (0 <= lo < hi <= self.vocab_size):
                raise EngineError(f"output_id_ranges entry [{lo}, {hi}) outside vocab [0, {self.vocab_size})")

    def signature(self) -> dict:
        """Shape identity: a hand-over between engines is refused unless signatures match."""
        d = asdict(self)
        d["output_id_ranges"] = [list(r) for r in self.output_id_ranges] if self.output_id_ranges else None
        return d

    def output_ids(self) -> list[int] | None:
        if self.output_id_ranges is None:
            return None
        ids: set[int] = set()
        for lo, hi in self.output_id_ranges:
            ids.update(range(lo, hi))
        return sorted(ids)


# Token ids of the toy task's completions (digits, JSON punctuation, the code words, the
# tool-call and turn-closing tokens) as half-open ranges.
TOY_OUTPUT_ID_RANGES: tuple[tuple[int, int], ...] = (
    (11, 12), (16, 26), (198, 199), (220, 221), (330, 331), (497, 498), (606, 607), (788, 789),
    (1203, 1204), (1851, 1852), (2518, 2519), (3691, 3692), (4158, 4159), (4913, 4914),
    (5212, 5213), (6176, 6177), (6303, 6304), (6623, 6624), (9278, 9279), (9788, 9789),
    (11248, 11249), (11794, 11795), (13876, 13877), (14961, 14962), (16009, 16010), (16370, 16371),
    (17545, 17546), (18217, 18218), (21020, 21021), (25814, 25815), (41719, 41720),
    (45207, 45208), (67605, 67606), (151643, 151644), (151645, 151646), (151657, 151659),
)

PRESETS: dict[str, ModelSpec] = {
    # CPU demos: Qwen3 vocabulary in the embedding, output restricted to the frequent BPE
    # ranks plus the chat special tokens so the output layer does not dominate CPU time.
    "tiny": ModelSpec(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=768, vocab_size=QWEN3_VOCAB,
        output_id_ranges=((0, 8192), (QWEN3_SPECIAL_FIRST, QWEN3_SPECIAL_END)),
    ),
    "small": ModelSpec(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
        intermediate_size=1536, vocab_size=QWEN3_VOCAB,
        output_id_ranges=((0, 16384), (QWEN3_SPECIAL_FIRST, QWEN3_SPECIAL_END)),
    ),
    # The toy agentic task (cells/trainer/toy_task/), trainable on CPU in minutes: Qwen3
    # vocabulary in the embedding (the real tokenizer and chat template work), output
    # restricted to the ids its completions use (toy_task.output_token_ids(); a test keeps
    # them in sync), so the output layer is 46 rows.
    "toy": ModelSpec(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=192, vocab_size=QWEN3_VOCAB, max_position=4096,
        output_id_ranges=TOY_OUTPUT_ID_RANGES,
    ),
    # The tokenizer's full vocabulary as output (what the gateway's tokenizer can produce).
    "qwen3-vocab": ModelSpec(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=768, vocab_size=QWEN3_VOCAB,
    ),
}

_OVERRIDABLE = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "vocab_size", "rope_theta", "rms_norm_eps", "max_position", "tie_word_embeddings",
)


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` (Qwen3 or Llama layout)."""
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"cannot read {cfg_path}: {e}") from None
    model_type = cfg.get("model_type", "qwen3")
    if model_type not in ("qwen3", "llama"):
        raise EngineError(f"unsupported model_type {model_type!r} in {cfg_path} (qwen3, llama)")
    try:
        heads = cfg["num_attention_heads"]
        return ModelSpec(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            output_id_ranges=_output_ranges(cfg, cfg_path),
        )
    except KeyError as e:
        raise EngineError(f"{cfg_path} lacks required key {e}") from None


def _output_ranges(cfg: dict, cfg_path: Path) -> tuple[tuple[int, int], ...] | None:
    """The output ids an export of a restricted model was sampled from (its config's `cellflip`
    key, cells/engine/embedded/checkpoint.py); None for a plain Hugging Face config."""
    raw = (cfg.get("cellflip") or {}).get("output_id_ranges")
    if raw is None:
        return None
    try:
        return tuple((int(lo), int(hi)) for lo, hi in raw)
    except (TypeError, ValueError):
        raise EngineError(f"{cfg_path}: cellflip.output_id_ranges must be [[lo, hi], ...], got {raw!r}") from None


def resolve_spec(cfg: ModelConfig) -> ModelSpec:
    """Preset (or checkpoint config) plus explicit overrides from the config file."""
    if cfg.path:
        base = spec_from_hf_config(cfg.path)
    elif cfg.preset:
        base = PRESETS[cfg.preset]
    else:
        raise EngineError("model config needs a preset or a checkpoint path")
    overrides = {k: getattr(cfg, k) for k in _OVERRIDABLE if getattr(cfg, k) is not None}
    if cfg.output_id_ranges is not None:
        overrides["output_id_ranges"] = tuple(tuple(r) for r in cfg.output_id_ranges)
    return replace(base, **overrides) if overrides else base

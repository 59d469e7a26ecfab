"""The engines' configs: the model (a Qwen3-family preset or checkpoint), the embedded torch
engine and the SGLang engine, one discriminated union."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from scheduler.contract.config.base import Strict as _Strict


class ModelConfig(_Strict):
    """Model architecture (Qwen3 family) or a preset name, optionally a checkpoint path."""

    preset: Literal["tiny", "small", "qwen3-vocab", "toy"] | None = "tiny"
    """Named size preset; explicit fields below override it."""
    path: str | None = None
    """Hugging Face checkpoint directory (config.json + *.safetensors); random-init if unset."""
    hidden_size: int | None = Field(default=None, gt=0)
    """Width of the residual stream."""
    num_layers: int | None = Field(default=None, gt=0)
    """Number of decoder layers."""
    num_heads: int | None = Field(default=None, gt=0)
    """Query heads per layer."""
    num_kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads per layer (GQA); must divide num_heads."""
    head_dim: int | None = Field(default=None, gt=0)
    """Width of one attention head."""
    intermediate_size: int | None = Field(default=None, gt=0)
    """Hidden width of the SwiGLU MLP."""
    vocab_size: int | None = Field(default=None, gt=0)
    """Embedding rows (the tokenizer's full vocabulary, padded as in the checkpoint)."""
    output_id_ranges: list[tuple[int, int]] | None = None
    """Restrict sampling and scoring to these half-open token-id ranges (None: all ids).
    Applied identically when sampling and scoring, so log-probs stay exact."""
    rope_theta: float | None = Field(default=None, gt=0)
    """RoPE base frequency."""
    rms_norm_eps: float | None = Field(default=None, gt=0)
    """RMSNorm epsilon."""
    max_position: int | None = Field(default=None, gt=0)
    """Largest supported context length (RoPE table size)."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding with the output layer."""
    seed: int = 0
    """Seed for random initialisation (ignored when a checkpoint path is given)."""


class EmbeddedEngineConfig(_Strict):
    """The embedded torch engine (CPU default; the reference implementation)."""

    type: Literal["embedded"] = "embedded"
    """Engine selector."""
    model: ModelConfig = ModelConfig()
    """Model to serve."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per KV block."""
    num_blocks: int | None = Field(default=None, gt=0)
    """KV blocks in the pool (per cell). Unset: 2048 on `cpu`; on a GPU, as many as
    `kv_memory_fraction` of the device's free memory holds once the weights are loaded."""
    kv_memory_fraction: float = Field(default=0.8, gt=0, le=1)
    """Share of the device's free memory (after the weights) the KV pool takes when
    `num_blocks` is unset (GPU only)."""
    max_running: int = Field(default=32, gt=0)
    """Most requests decoding at once."""
    prefill_chunk: int = Field(default=512, gt=0)
    """Most prompt tokens prefilled per engine step (chunked prefill budget)."""
    batch_invariant: bool = False
    """Batch-invariant numerics: a token's log-prob does not depend on its batch, and the
    decode and scoring paths agree bitwise."""
    row_tile: int = Field(default=4, gt=0)
    """Rows per fixed-shape matmul tile in batch-invariant mode."""
    threads: int = Field(default=1, gt=0)
    """torch intra-op threads in the cell process."""
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    """Where weights, the KV pool, sampling and scoring live: `cpu`, `cuda` (the cell's local
    GPU: `LOCAL_RANK`, else the current device) or `cuda:N`."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights, activations and KV cache dtype (log-softmax and sampling run in float32)."""


class SGLangEngineConfig(_Strict):
    """SGLang on GPU cells (needs the `gpu` extra)."""

    type: Literal["sglang"] = "sglang"
    """Engine selector."""
    model_path: str
    """Model directory or hub-free local path."""
    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree."""
    mem_fraction_static: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory SGLang reserves."""
    scoring: Literal["cell_copy", "publisher_copy"] = "publisher_copy"
    """Where old log-probs are computed: a scoring copy of the version on the cell (host
    memory: 4 bytes per parameter), or on another cell that can score, from the copy the
    publishing cell keeps of every unretired version (no memory on this cell)."""

    @field_validator("scoring", mode="before")
    @classmethod
    def _no_trainer_copy(cls, v: Any) -> Any:
        if v == "trainer_copy":
            raise ValueError("scoring 'trainer_copy' is gone: the trainer holds no versions; use 'publisher_copy' "
                             "(another cell scores, from the publishing cell's kept copy) or 'cell_copy'")
        return v
    server_args: dict[str, Any] = {}
    """Extra `sglang.Engine` arguments (HiCache storage, page size, attention backend…); they
    override the adapter's, except that they cannot switch `deterministic` off."""
    deterministic: bool = False
    """Start SGLang with `enable_deterministic_inference` (batch-invariant kernels, and the
    per-request `sampling_seed` honoured). Needed for token-exact re-prefill migration, which
    holds between cells of the same `tp` (docs/GPU.md); costs decode throughput. Off: a moved
    request loses and doubles no token, but may continue differently."""
    kv_store: str | None = None
    """Name of a shared hierarchical KV store, when its backend config alone does not say."""
    max_running: int = Field(default=256, gt=0)
    """Request slots this cell reports to the scheduler."""


EngineConfig = Annotated[EmbeddedEngineConfig | SGLangEngineConfig, Field(discriminator="type")]


def served_model(engine: EmbeddedEngineConfig | SGLangEngineConfig) -> str | None:
    """The model a cell of this engine runs, as it names it when it registers (which RL jobs it
    may serve, scheduler/control/jobmodels.py): the checkpoint or model path, else the preset."""
    if isinstance(engine, SGLangEngineConfig):
        return engine.model_path
    return engine.model.path or engine.model.preset

"""The `gateway:` section: the OpenAI-compatible gateway's settings (strict, documented fields).

The application can embed :class:`GatewayConfig` in its own configuration and build the
router with ``make_chat_router(backend, cfg.renderer, **cfg.router_kwargs())``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["GatewayConfig"]


DEFAULT_MAX_PROMPT_TOKENS = 65536
"""A turn whose prompt is longer is refused (400) unless the config says otherwise."""

class GatewayConfig(BaseModel):
    """The OpenAI-compatible TITO gateway."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    renderer: Literal["qwen3", "qwen3-nothink", "deepseek-v3"] = "qwen3"
    """Chat format: tokenizer + ``renderers`` config preset (see scheduler.gateway.tito.render)."""
    model_name: str | None = None
    """Model name reported in responses when the request names none (default: the preset)."""
    max_body_bytes: int = Field(default=8 << 20, gt=0)
    """Largest accepted request body (413 beyond)."""
    default_max_tokens: int | None = Field(default=None, gt=0)
    """Completion length limit when a request sets none (None: the engine's own limit)."""
    max_prompt_tokens: int | None = Field(default=DEFAULT_MAX_PROMPT_TOKENS, gt=0)
    """Refuse turns whose prompt would exceed this many tokens (400 context_length_exceeded);
    None: no limit. Set it to the served model's context length."""
    use_bridge: bool = True
    """Extend sessions with ``bridge_to_next_turn``; False always uses the render difference."""
    finish_route: bool = True
    """Serve ``POST /v1/sessions/{id}/finish`` from the gateway router."""

    def router_kwargs(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_body_bytes": self.max_body_bytes,
            "default_max_tokens": self.default_max_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "use_bridge": self.use_bridge,
            "finish_route": self.finish_route,
        }

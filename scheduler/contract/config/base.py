"""The base of every config model, and the error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the key and the value."""


class Strict(BaseModel):
    """Unknown keys are refused; every field carries a docstring; values are frozen."""


    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

"""Model providers the agents call: `echo` (deterministic, no network) and `openai`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from supervisor.contract.config import ModelConfig
from workers.models.base import (
    SILENT,
    Message,
    Model,
    ModelError,
    ModelResponse,
    Stream,
    ToolCall,
    ToolSpec,
)
from workers.models.echo import EchoModel

if TYPE_CHECKING:
    from workers.models.openai import OpenAIModel

__all__ = [
    "SILENT",
    "EchoModel",
    "Message",
    "Model",
    "ModelError",
    "ModelResponse",
    "OpenAIModel",
    "Stream",
    "ToolCall",
    "ToolSpec",
    "make_model",
]


def __getattr__(name: str) -> Any:
    """`OpenAIModel` on first use: httpx costs a worker ~0.1 s to import, for nothing when
    the echo model runs."""
    if name == "OpenAIModel":
        from workers.models.openai import OpenAIModel

        return OpenAIModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_model(cfg: ModelConfig, environ: Mapping[str, str] | None = None) -> Model:
    """The provider `cfg` names; the API key is read from `environ[cfg.api_key_env]`.

    Raises `ModelError` (not transient) when `api_key_env` names a variable that is
    unset or empty in `environ` (default: the process environment).
    """
    if cfg.provider == "echo":
        return EchoModel(delay=cfg.delay, max_tokens=cfg.max_tokens, window=cfg.context_window)
    environ = os.environ if environ is None else environ
    api_key: str | None = None
    if cfg.api_key_env:
        api_key = environ.get(cfg.api_key_env)
        if not api_key:
            raise ModelError(
                f"model.api_key_env names the environment variable {cfg.api_key_env}, "
                "which is not set; set it to the model server's API key"
            )
    from workers.models.openai import OpenAIModel

    return OpenAIModel(
        base_url=cfg.base_url,
        model=cfg.model,
        api_key=api_key,
        timeout=cfg.timeout,
        max_tokens=cfg.max_tokens,
        max_response_bytes=cfg.max_response_bytes,
        stream=cfg.stream,
    )

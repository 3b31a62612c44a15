"""``LoadConfig``: how the weights are read.

vLLM's counterpart is ``vllm/config/load.py``. Only local safetensors in Hugging Face layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.utils import ConfigError


@dataclass
class LoadConfig:
    """How weights are read. Only local safetensors in Hugging Face layout."""

    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors"):
            raise ConfigError("--load-format", self.load_format, "allowed: auto, safetensors")

"""``DeviceConfig``: where the workers run.

vLLM's counterpart is ``vllm/config/device.py``; "auto" is resolved by the worker (vLLM
resolves it through its platform layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.utils import ConfigError

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class DeviceConfig:
    """Where the worker runs: "auto" picks CUDA when present, else CPU (resolved by the worker)."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("--device", self.device, f"allowed: {', '.join(DEVICES)}")

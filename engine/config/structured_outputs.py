"""``StructuredOutputsConfig``: which grammar backend compiles structured outputs, and its options.

vLLM's counterpart is ``vllm/config/structured_outputs.py``, set with
``--structured-outputs-config '{"backend": ...}'`` (vLLM 0.12 removed the older
``--guided-decoding-backend``; Glassbox refuses it, naming the new flag). Glassbox has one
backend, llguidance (vLLM's
``"guidance"``); ``"auto"`` (vLLM's default, which prefers xgrammar) resolves to it. The other
vLLM backends (``xgrammar``, ``outlines``, ``lm-format-enforcer``) are refused, naming the flag.

Left out: ``reasoning_parser``, ``enable_in_reasoning``, ``disable_fallback`` (there is
nothing to fall back to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config.utils import ConfigError

# vLLM's backend names; Glassbox runs the first two (both mean llguidance).
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")
VLLM_ONLY_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    """Structured-output settings (vLLM: ``StructuredOutputsConfig``).

    Attributes:
        backend: ``auto`` or ``guidance`` (both llguidance).
        disable_any_whitespace: JSON without whitespace between tokens (vLLM's option).
        disable_additional_properties: object schemas without ``additionalProperties`` take
            no other keys (vLLM's option for the guidance backend; xgrammar behaves so).
        whitespace_pattern: a regex for the whitespace JSON output may hold, or None.
    """

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.backend in VLLM_ONLY_BACKENDS:
            raise ConfigError(
                "--structured-outputs-config", self.backend,
                f"backend {self.backend!r} is one of vLLM's; Glassbox runs llguidance: use 'guidance' or 'auto'",
            )  # fmt: skip
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ConfigError("--structured-outputs-config", self.backend,
                              f"backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}")  # fmt: skip
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    "--structured-outputs-config", getattr(self, name), f"{name} must be true or false"
                )
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ConfigError("--structured-outputs-config", self.whitespace_pattern,
                              "whitespace_pattern must be a string")  # fmt: skip

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> StructuredOutputsConfig:
        """From ``--structured-outputs-config``'s JSON object.

        Raises:
            ConfigError: an unknown key or a bad value, naming the flag.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError("--structured-outputs-config", ", ".join(unknown),
                              f"unknown key(s); known: {', '.join(sorted(known))}")  # fmt: skip
        return cls(**value)

"""Glassbox: a see-through re-implementation of the vLLM V1 serving engine.

``from engine import LLM, SamplingParams`` (``PoolingParams`` for embeddings) — the names are vLLM's. Importing this package
is cheap (no torch): the heavy modules load when ``LLM`` is first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "engine.entrypoints.llm",
    "SamplingParams": "engine.sampling_params",
    "PoolingParams": "engine.pooling_params",
    "RequestOutput": "engine.frontend.outputs",
    "CompletionOutput": "engine.frontend.outputs",
    "TokensPrompt": "engine.frontend.outputs",
    "TextPrompt": "engine.frontend.outputs",
    "PoolingOutput": "engine.frontend.outputs",
    "PoolingRequestOutput": "engine.frontend.outputs",
    "EmbeddingOutput": "engine.frontend.outputs",
    "EmbeddingRequestOutput": "engine.frontend.outputs",
    "EngineArgs": "engine.engine_args",
    "EngineConfig": "engine.config",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

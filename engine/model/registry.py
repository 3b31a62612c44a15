"""Which model class serves a ``config.json`` architecture (vLLM: ``vllm/model_executor/models/registry.py``).

Classes are named by module and class and imported when asked for, as vLLM's registry does,
so the dense path never imports the MoE models' modules.
"""

from __future__ import annotations

import importlib

from torch import nn

# config.json "architectures" entry → "module:Class"
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "engine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "engine.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.model.llama:Qwen3ForCausalLM",
    "MixtralForCausalLM": "engine.model.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.model.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.model.qwen_moe:Qwen3MoeForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for a ``config.json`` architecture name (vLLM: ``ModelRegistry``).

    Raises:
        ValueError: the architecture is not one we implement.
    """
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        )
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(importlib.import_module(module), name)

"""``GET /v1/models``: the one model this server serves, under its served name.

Mirrors vLLM's ``vllm/entrypoints/openai/serving_models.py`` (``OpenAIServingModels``).

Left out: LoRA adapters (vLLM lists them as extra cards, ``parent`` = the base model),
several served names for one model, ``permission`` entries.
"""

from __future__ import annotations

from engine.entrypoints.openai.protocol import ModelCard, ModelList
from engine.frontend.async_llm import AsyncLLM


class OpenAIServingModels:
    """Knows the served model's name and card.

    Args:
        engine: gives the model path (``root``) and ``max_model_len``.
        served_model_name: the ``id`` clients send as ``model``.
    """

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.served_model_name = served_model_name
        self.model_path = engine.model_config.model
        self.max_model_len = engine.model_config.max_model_len

    def show_available_models(self) -> ModelList:
        card = ModelCard(id=self.served_model_name, root=self.model_path, max_model_len=self.max_model_len)
        return ModelList(data=[card])

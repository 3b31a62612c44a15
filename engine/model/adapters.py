"""Adapters that turn a text generator into a pooling model (``--convert embed``).

Mirrors vLLM's ``vllm/model_executor/models/adapters.py`` (``as_embedding_model``): the
causal LM class is subclassed, its LM head dropped (a pooling model never computes logits,
and its checkpoint's ``lm_head.weight`` is skipped, never read), and a ``pooler`` made from
the ``PoolerConfig`` takes its place. The decoder itself is untouched: ``forward`` still maps
token ids to the final hidden states ``(num_tokens, hidden)``, compiled or eager, and the
model runner hands those to ``model.pooler``.

Left out: ``as_seq_cls_model`` (``--convert classify``) and Sentence Transformers' dense
projection layers (``_load_st_projector``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.config import PoolerConfig
from engine.model.pooler import pooler_for_embed
from engine.model.utils import PPMissingLayer


def as_embedding_model(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` (a ``*ForCausalLM``) as an embedding model: built with
    ``(config, pooler_config=...)``, holding ``pooler`` instead of ``lm_head``.

    The class is named after vLLM's (``LlamaForCausalLM`` → ``LlamaEmbeddingModel``).
    """

    class ModelForEmbedding(cls):  # type: ignore[misc, valid-type]
        is_pooling_model = True

        def __init__(self, config: dict[str, Any], *, pooler_config: PoolerConfig) -> None:
            super().__init__(config)
            # No logits: the head goes (a placeholder, so its checkpoint tensor is skipped).
            self.lm_head = PPMissingLayer()
            self.pooler = pooler_for_embed(pooler_config.seq_pooling_type or "LAST")

    ModelForEmbedding.__name__ = ModelForEmbedding.__qualname__ = (
        cls.__name__.removesuffix("ForCausalLM") + "EmbeddingModel"
    )
    return ModelForEmbedding

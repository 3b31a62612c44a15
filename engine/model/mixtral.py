"""Mixtral: Mistral's decoder with a mixture of experts in place of every MLP.

Mirrors vLLM's ``vllm/model_executor/models/mixtral.py``. Each decoder layer's feed-forward
is a ``SparseMoeBlock`` (``engine/model/moe.py``): a router over ``num_local_experts``
experts, each token through its ``num_experts_per_tok`` best, their outputs weighted by a
softmax over those experts' router logits (softmax, top-k, renormalised). Attention is
Mistral's (``engine/model/llama.py``).

Checkpoint names: Mixtral calls the block ``block_sparse_moe`` (``...block_sparse_moe.gate``,
``...block_sparse_moe.experts.<e>.w1|w2|w3``: gate, down, up); here the layer's block is
``mlp`` whatever the family, so those names are read as ``mlp.*`` (``checkpoint_renames``),
and each expert's three tensors land in ``FusedMoE``'s stacked ``w13_weight``/``w2_weight``.

Left out: router jitter noise (training only), the auxiliary load-balancing loss (training only).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.model.llama import MistralForCausalLM
from engine.model.moe import FusedMoE, SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral (``config.json``: ``num_local_experts``, ``num_experts_per_tok``, and
    ``intermediate_size`` for each expert): every layer's MLP is a ``SparseMoeBlock``."""

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.expert_params_mapping = FusedMoE.make_expert_params_mapping(
            "w1", "w2", "w3", int(config["num_local_experts"])
        )

    def make_mlp(self, layer_idx: int, local_index: int) -> nn.Module:
        config = self.config
        return SparseMoeBlock(
            int(config["hidden_size"]),
            num_experts=int(config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["intermediate_size"]),
            renormalize=True,  # Mixtral: softmax over the top-k logits
            layer_index=local_index,
        )

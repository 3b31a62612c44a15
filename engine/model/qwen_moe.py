"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with a mixture of experts in (most) MLPs.

Mirrors vLLM's ``vllm/model_executor/models/qwen2_moe.py`` and ``qwen3_moe.py``. Attention is
Qwen2's (bias on Q/K/V) or Qwen3's (per-head q/k norm), from ``engine/model/llama.py``. Layer
``i``'s feed-forward is a ``SparseMoeBlock`` (``engine/model/moe.py``) unless ``i`` is in
``mlp_only_layers`` or ``(i + 1)`` is not a multiple of ``decoder_sparse_step``; those keep a
dense MLP of ``intermediate_size``. The experts are ``num_experts`` (transformers 5 writes
``num_local_experts``) SwiGLU MLPs of
``moe_intermediate_size``, ``num_experts_per_tok`` per token, their softmax weights rescaled to
sum to 1 only when ``norm_topk_prob`` is set. Qwen2-MoE adds a shared expert of
``shared_expert_intermediate_size`` that every token goes through, gated by
``sigmoid(shared_expert_gate(x))``; Qwen3-MoE has none.

Checkpoint names (``...mlp.gate``, ``...mlp.experts.<e>.gate_proj|up_proj|down_proj``,
``...mlp.shared_expert.*``, ``...mlp.shared_expert_gate``) are the modules' own; each expert's
three tensors land in ``FusedMoE``'s stacked ``w13_weight``/``w2_weight``.

Left out: the auxiliary load-balancing loss (training only).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.model.llama import LlamaMLP, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.model.moe import FusedMoE, SparseMoeBlock


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per layer: ``num_experts`` in Qwen's own checkpoints, ``num_local_experts``
    in those transformers 5 writes."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def is_sparse_layer(config: dict[str, Any], layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a Qwen MoE config has experts (else a dense MLP)."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return (
        layer_idx not in (config.get("mlp_only_layers") or [])
        and num_experts(config) > 0
        and (layer_idx + 1) % step == 0
    )


class _QwenMoeMixin:
    """What Qwen2-MoE and Qwen3-MoE share: which layers are sparse, and their blocks."""

    config: dict[str, Any]
    has_shared_expert = False

    def _init_experts(self) -> None:
        self.expert_params_mapping = FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", num_experts(self.config)
        )

    def make_mlp(self, layer_idx: int, local_index: int) -> nn.Module:
        config = self.config
        hidden = int(config["hidden_size"])
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(hidden, int(config["intermediate_size"]))
        shared = None
        if self.has_shared_expert:
            shared = LlamaMLP(hidden, int(config["shared_expert_intermediate_size"]))
        return SparseMoeBlock(
            hidden,
            num_experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            renormalize=bool(config.get("norm_topk_prob", False)),
            layer_index=local_index,
            shared_expert=shared,
        )


class Qwen2MoeForCausalLM(_QwenMoeMixin, Qwen2ForCausalLM):
    """Qwen2-MoE: Qwen2 attention, routed experts plus a gated shared expert."""

    has_shared_expert = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._init_experts()


class Qwen3MoeForCausalLM(_QwenMoeMixin, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norm), routed experts, no shared expert."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._init_experts()

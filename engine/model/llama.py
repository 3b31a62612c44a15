"""The Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 in one module.

Mirrors vLLM's ``vllm/model_executor/models/llama.py`` (and the small differences of
``qwen2.py`` and ``qwen3.py``). The four architectures share one block:

    x → RMSNorm → attention (QKV → RoPE → paged attention → O) → + x
      → RMSNorm → MLP (gate_up → SiLU·mul → down) → + x

and differ only in small switches, kept as class attributes of the subclasses:

- Qwen2 always has a bias on the Q/K/V projections (none on O);
- Qwen3 normalises each query and key head (``q_norm``/``k_norm``, RMSNorm over
  ``head_dim``) before RoPE;
- Mistral applies ``sliding_window`` on every layer when the config sets it; Qwen2/Qwen3
  only when ``use_sliding_window`` is true, and then on layers
  ``>= max_window_layers`` (or as ``layer_types`` says).

The model maps token ids and attention metadata to hidden states and logits; it knows
nothing of requests, scheduling or processes. The mixtures of experts (``mixtral.py``,
``qwen_moe.py``) are these classes with another feed-forward block per layer (``make_mlp``)
and their experts' checkpoint names (``expert_params_mapping``, ``checkpoint_renames``); the
class for an architecture is chosen in ``registry.py``.

Tied embeddings (``tie_word_embeddings``) make the LM head the embedding table itself.

Tensor parallelism lives in the layers (``layers.py``): built inside a worker of a TP
group, each one takes its rank's slice (heads, MLP columns, vocabulary rows) and
``load_weights`` cuts that slice out of each checkpoint tensor as it streams past.

Pipeline parallelism: built on stage p of P, the model holds only decoder layers
``get_pp_indices(num_hidden_layers, p, P)`` (others are ``PPMissingLayer``), the embedding
only on the first stage, the final norm and LM head only on the last (with tied embeddings
the last stage holds the embedding too, as its LM head). ``forward`` then takes the previous
stage's ``IntermediateTensors`` instead of token ids, and returns ``IntermediateTensors``
on every stage but the last.

Left out: LoRA, quantized weights, ``inputs_embeds``, fused residual-add norms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.distributed.parallel_state import get_pp_group
from engine.distributed.utils import get_pp_indices
from engine.model.attention import Attention, AttentionMetadata, KVCache
from engine.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
    rope_parameters_from_config,
)
from engine.model.utils import IntermediateTensors, PPMissingLayer, pp_missing_prefixes


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, (num_tokens, hidden) → same."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (num_tokens, hidden)


class LlamaAttention(nn.Module):
    """Self-attention of one layer: QKV projection, optional per-head q/k norm, RoPE, attention, O."""

    def __init__(
        self,
        config: dict[str, Any],
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        total_heads = int(config["num_attention_heads"])
        total_kv_heads = int(config.get("num_key_value_heads") or total_heads)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, bias=o_bias)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.attn = Attention(
            self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, sliding_window, layer_index
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (num_tokens, (heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: per head, before RoPE
        q, k = RotaryEmbedding.apply(q, k, *cos_sin)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # (num_tokens, heads * head_dim)
        return self.o_proj(out)  # (num_tokens, hidden)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection. ``mlp`` maps (num_tokens,
    hidden) to the same: a ``LlamaMLP``, or an MoE block (``engine/model/moe.py``)."""

    def __init__(self, config: dict[str, Any], attention: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # (num_tokens, hidden)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm (Hugging Face prefix ``model.``).

    On pipeline stage p only layers ``[start_layer, end_layer)`` are real; ``kv_caches`` then
    holds one (K, V) pair per *local* layer.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        config: dict[str, Any],
        head_dim: int,
        start_layer: int = 0,
        end_layer: int | None = None,
        is_first_rank: bool = True,
        is_last_rank: bool = True,
    ) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.start_layer = start_layer
        self.end_layer = len(layers) if end_layer is None else end_layer
        self.is_first_rank, self.is_last_rank = is_first_rank, is_last_rank
        tied = bool(config.get("tie_word_embeddings", False))
        if is_first_rank or (tied and is_last_rank):  # tied: the last stage's LM head is this table
            self.embed_tokens = VocabParallelEmbedding(int(config["vocab_size"]), hidden)
        else:
            self.embed_tokens = PPMissingLayer()
        self.layers = nn.ModuleList(layers)
        self.norm = (
            RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6))) if is_last_rank else PPMissingLayer()
        )
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters_from_config(config))
        self.hidden_size = hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache] | None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_rank:
            hidden = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        else:
            hidden = intermediate_tensors["hidden_states"]  # from the previous stage
        cos_sin = self.rotary_emb.get_cos_sin(positions, hidden.dtype)  # 2 x (num_tokens, 1, head_dim)
        for i in range(self.start_layer, self.end_layer):
            kv_cache = kv_caches[i - self.start_layer] if kv_caches else None
            hidden = self.layers[i](hidden, cos_sin, kv_cache, attn_metadata)
        if not self.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden})
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """A causal LM of the Llama family, built from a ``config.json`` dict.

    ``forward(input_ids (T,), positions (T,), attn_metadata, kv_caches) -> (T, hidden)``;
    ``compute_logits(hidden (N, hidden)) -> (N, vocab)`` float32;
    ``load_weights(iterable of (hf_name, tensor)) -> set of loaded parameter names``.
    ``kv_caches`` holds one (K, V) pair per layer, or is None/empty when profiling.
    """

    qkv_bias_always = False  # Qwen2: bias on q/k/v whatever the config says
    has_qk_norm = False  # Qwen3
    sliding_window_needs_flag = False  # Qwen2/3: the window applies only with use_sliding_window

    # checkpoint name fragment → our name fragment, applied first (Mixtral's block_sparse_moe → mlp)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # MoE models: (param fragment, checkpoint fragment, expert id, shard id) per expert tensor
    # (``FusedMoE.make_expert_params_mapping``), matched before stacked_params_mapping.
    expert_params_mapping: list[tuple[str, str, int, str]] = []
    # checkpoint name fragment → (our parameter fragment, shard id)
    stacked_params_mapping = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        self.head_dim = int(config.get("head_dim") or hidden // num_heads)
        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias = attention_bias or self.qkv_bias_always
        o_bias = attention_bias and not self.qkv_bias_always
        # Pipeline parallelism: this stage's layers (all of them without a PP group).
        pp = get_pp_group()
        pp_rank, pp_size = (pp.rank_in_group, pp.world_size) if pp is not None else (0, 1)
        num_layers = int(config["num_hidden_layers"])
        start, end = get_pp_indices(num_layers, pp_rank, pp_size)
        layers: list[nn.Module] = []
        for i in range(num_layers):
            if not start <= i < end:
                layers.append(PPMissingLayer())
                continue
            attention = LlamaAttention(
                config,
                self.head_dim,
                qkv_bias,
                o_bias,
                self.has_qk_norm,
                self.layer_sliding_window(i),
                i - start,
            )
            layers.append(LlamaDecoderLayer(config, attention, self.make_mlp(i, i - start)))
        is_last = pp_rank == pp_size - 1
        self.model = LlamaModel(layers, config, self.head_dim, start, end, pp_rank == 0, is_last)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if not is_last:
            self.lm_head = PPMissingLayer()  # only the last stage computes logits
        elif self.tie_word_embeddings:
            # Tied: the output projection *is* the embedding table (one tensor, loaded once).
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(int(config["vocab_size"]), hidden)

    def make_mlp(self, layer_idx: int, local_index: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (``local_index``: its index on this pipeline
        stage): the SwiGLU MLP here, an MoE block in the MoE models."""
        config = self.config
        return LlamaMLP(int(config["hidden_size"]), int(config["intermediate_size"]),
                        bias=bool(config.get("mlp_bias", False)))  # fmt: skip

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` in tokens, or None for full attention."""
        window = self.config.get("sliding_window")
        if window is None:
            return None
        if self.sliding_window_needs_flag and not self.config.get("use_sliding_window", False):
            return None
        layer_types = self.config.get("layer_types")
        if layer_types:
            return int(window) if layer_types[layer_idx] == "sliding_attention" else None
        if self.sliding_window_needs_flag:
            first = int(self.config.get("max_window_layers", 0))
            return int(window) if layer_idx >= first else None
        return int(window)

    @property
    def sliding_window(self) -> int | None:
        """The window shared by every layer, or None when any layer attends fully."""
        windows = {layer.self_attn.attn.sliding_window for layer in self.local_layers}
        return windows.pop() if len(windows) == 1 else None

    @property
    def local_layers(self) -> list[LlamaDecoderLayer]:
        """The decoder layers this pipeline stage runs (all of them without PP)."""
        return list(self.model.layers[self.model.start_layer : self.model.end_layer])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache] | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``(T, hidden)`` on the last stage, else ``IntermediateTensors`` for the next one."""
        return self.model(input_ids, positions, attn_metadata, kv_caches, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden)`` → ``(N, vocab)`` float32, the same on every TP rank (vocab slices all-gathered)."""
        return self.lm_head.compute_logits(hidden)

    def _load_expert_weight(self, params: dict[str, nn.Parameter], hf_name: str, tensor: Any) -> str | None:
        """Load ``hf_name`` if it is one expert's tensor (``expert_params_mapping``): returns the
        parameter's name ("" when another EP rank holds that expert and nothing was read),
        None when it is not an expert's tensor."""
        for param_fragment, weight_fragment, expert_id, shard_id in self.expert_params_mapping:
            if weight_fragment in hf_name:
                # ...experts.3.w1.weight → ...experts.w13_weight
                name = hf_name.replace(weight_fragment, param_fragment)
                if name not in params:
                    raise KeyError(f"checkpoint tensor {hf_name!r} has no parameter {name!r}")
                loaded = params[name].weight_loader(params[name], tensor, hf_name, shard_id, expert_id)
                return name if loaded else ""
        return None

    def describe_parameter(self, name: str) -> str:
        """``name``, plus the checkpoint tensors it is stacked from (for error messages)."""
        sources = [
            fragment.strip(".") for fragment, target, _ in self.stacked_params_mapping if target in name
        ]
        return f"{name} (from {'/'.join(sources)})" if sources else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face tensors into our parameters.

        ``q_proj``/``k_proj``/``v_proj`` land in ``qkv_proj`` and ``gate_proj``/``up_proj``
        in ``gate_up_proj``, each as a shard. Rotary ``inv_freq`` buffers are skipped, and so
        is ``lm_head.weight`` when the embeddings are tied. Returns the names of parameters
        fully loaded (a merged one counts once all its shards arrived).

        Raises:
            KeyError: a checkpoint tensor matches no parameter.
            ValueError: a tensor's shape does not fit its parameter.
        """
        params = dict(self.named_parameters())
        shards_needed = {name: getattr(param, "shards_needed", 0) for name, param in params.items()}
        for _, target, _ in self.stacked_params_mapping:
            for name in params:
                if target in name:
                    shards_needed[name] += 1
        shards_seen: dict[str, int] = {}
        missing = pp_missing_prefixes(self)  # other pipeline stages' modules
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or "rotary_emb.cos_cached" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for fragment, ours in self.checkpoint_renames:
                hf_name = hf_name.replace(fragment, ours)
            if hf_name.startswith(missing):
                continue  # held by another pipeline stage: never read
            expert = self._load_expert_weight(params, hf_name, tensor)
            if expert is not None:
                if expert:  # this rank holds the expert (expert parallelism: else another does)
                    shards_seen[expert] = shards_seen.get(expert, 0) + 1
                continue
            for fragment, target, shard_id in self.stacked_params_mapping:
                if fragment in hf_name:
                    name = hf_name.replace(fragment, target)
                    if name not in params:
                        raise KeyError(f"checkpoint tensor {hf_name!r} has no parameter {name!r}")
                    params[name].weight_loader(params[name], tensor, shard_id)
                    break
            else:
                name = hf_name
                if name not in params:
                    raise KeyError(
                        f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}"
                    )
                loader = getattr(params[name], "weight_loader", None)
                if loader is None:
                    default_weight_loader(params[name], tensor)
                else:
                    loader(params[name], tensor)
            shards_seen[name] = shards_seen.get(name, 0) + 1
        return {name for name, n in shards_seen.items() if n >= max(1, shards_needed[name])}


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with (optionally) a sliding window on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5: bias on the Q/K/V projections; sliding window only with ``use_sliding_window``."""

    qkv_bias_always = True
    sliding_window_needs_flag = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on queries and keys before RoPE; bias from ``attention_bias``."""

    has_qk_norm = True
    sliding_window_needs_flag = True

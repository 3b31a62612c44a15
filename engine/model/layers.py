"""Building blocks of the Llama-family decoder: norm, rotary embedding, activation, linears.

Mirrors vLLM's ``vllm/model_executor/layers/`` (``layernorm.py``, ``rotary_embedding/``,
``activation.py``, ``linear.py``, ``vocab_parallel_embedding.py``), written in plain torch.

The linear layers are tensor-parallel: each holds only its rank's slice of the weight,
and its ``weight_loader(param, loaded_weight, shard_id=None)`` cuts that slice out of the
full Hugging Face tensor, so a rank never keeps more than its share. ``tp_rank`` and
``tp_size`` default to this process's place in the TP group
(``engine.distributed.parallel_state``; rank 0 of 1 when there is no group). Where the
ranks talk, one step of one decoder layer::

    x (full, every rank) → QKV column-parallel (own heads) → attention (own heads, own KV)
      → O row-parallel (partial sums) → all-reduce → + x
      → gate_up column-parallel (own slice) → SiLU·mul → down row-parallel → all-reduce → + x

plus an all-reduce after the vocab-parallel embedding and an all-gather of the LM head's
logit slices: 2 × num_layers + 1 all-reduces and 1 all-gather per forward.

Parameters are created with ``torch.empty`` on the current default device and dtype (the
loader sets both): weights come from the checkpoint, so initialising them would only cost
time.

Each linear (and the LM head) multiplies through its ``linear_method`` (vLLM:
``quant_method``, a ``LinearMethodBase``): here ``UnquantizedLinearMethod``, plain
``F.linear``. On a CPU the loader swaps in ``CPUPackedLinearMethod`` after loading
(``engine/model/cpu/linear.py``: the weights pre-packed for oneDNN, and bfloat16 run as
float32 where that is faster); this file does not know it exists.

Left out: fused residual-add RMSNorm, quantization, vocab padding, RoPE types other than
default / linear / llama3 (yarn, dynamic NTK, longrope, partial rotary).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def _tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """``(rank, size)`` as given, else this process's place in the TP group."""
    size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    return rank, size


# ----------------------------------------------------------------------------- norm, act


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / rms(x) * weight``, computed in float32 like Hugging Face.

    Shapes: ``x`` is ``(..., hidden_size)``; the result has ``x``'s shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        # Cast back before the weight multiply, as transformers does, so bf16 runs agree.
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class SiluAndMul(nn.Module):
    """SwiGLU's gate: ``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``(..., 2d)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


# ----------------------------------------------------------------------------- rotary


def rope_parameters_from_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a ``config.json``, in one shape whatever wrote it.

    transformers 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``;
    transformers 4 writes ``rope_theta`` next to an optional ``rope_scaling`` dict (whose
    type key is ``rope_type`` or, in older files, ``type``). Returns a dict with at least
    ``rope_type`` and ``rope_theta``, plus the scaling fields of that type.
    """
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params.pop("type", None)
    params.setdefault("rope_theta", float(hf_config.get("rope_theta", 10000.0)))
    if params["rope_type"] == "llama3":
        params.setdefault(
            "original_max_position_embeddings", int(hf_config.get("max_position_embeddings", 8192))
        )
    return params


def compute_inv_freq(head_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``(head_dim // 2,)`` float32 for one of the supported RoPE types.

    Raises:
        ValueError: for a ``rope_type`` other than default, linear or llama3.
    """
    rope_type = rope_parameters["rope_type"]
    base = float(rope_parameters["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # (head_dim // 2,)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Position interpolation: positions / factor, i.e. every frequency / factor.
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band in
        # between blended smoothly.
        factor = float(rope_parameters["factor"])
        low = float(rope_parameters["low_freq_factor"])
        high = float(rope_parameters["high_freq_factor"])
        old_len = float(rope_parameters["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" (GPT-NeoX) layout Llama checkpoints use.

    ``get_cos_sin(positions)`` is computed once per forward and shared by all layers;
    ``apply(q, k, cos, sin)`` rotates queries and keys. vLLM: ``get_rope`` /
    ``RotaryEmbedding`` (which caches a cos/sin table instead; ours is computed from the
    positions each step, which costs one small outer product and needs no table of
    ``max_position_embeddings`` rows).
    """

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_parameters = rope_parameters
        # Not a parameter and not in the checkpoint; float32 whatever the model dtype.
        self.register_buffer(
            "inv_freq", compute_inv_freq(head_dim, rope_parameters).to(torch.float32), persistent=False
        )

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``(num_tokens, 1, head_dim)`` in ``dtype``, for ``positions`` (num_tokens,)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (num_tokens, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (num_tokens, 1, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` (num_tokens, num_heads, head_dim) and ``k`` (num_tokens, num_kv_heads, head_dim)."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ----------------------------------------------------------------------------- linears


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into ``param`` (dtype and device converted).

    ``loaded_weight`` may be a ``loader.LazySlice`` (TP loading): it is read here, after
    the caller narrowed it to this rank's slice.

    Raises:
        ValueError: when the shapes differ.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    if not isinstance(loaded_weight, torch.Tensor):
        loaded_weight = loaded_weight.load()  # reads only the slice, now that it is known
    param.data.copy_(loaded_weight)


class LinearMethodBase:
    """How a linear layer keeps and multiplies its weight (vLLM: ``LinearMethodBase``).

    ``create_weights`` makes the layer's ``weight`` parameter ``(output_size_per_partition,
    input_size_per_partition)`` with ``weight_loader`` attached (deviation: vLLM's also takes
    the dtype and the unsplit sizes; ours reads the default dtype and needs no more);
    ``process_weights_after_loading`` is called once the checkpoint is in; ``apply`` computes
    ``x W^T + b`` for ``x`` (num_tokens, in) → (num_tokens, out).
    """

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_size_per_partition: int, weight_loader
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to do after loading."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The reference: the weight as loaded, multiplied by ``F.linear`` (vLLM:
    ``UnquantizedLinearMethod``). On a CPU the loader replaces it with
    ``CPUPackedLinearMethod`` (``engine/model/cpu/linear.py``) once the weights are in."""

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int, output_size_per_partition: int, weight_loader
    ) -> None:
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition))
        layer.weight = _set_loader(weight, weight_loader)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # read by the model's load_weights
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split by output rows: rank r holds rows ``[r*n, (r+1)*n)``.

    Shapes: ``x`` (num_tokens, input_size) → ``y`` (num_tokens, output_size // tp_size).
    vLLM: ``ColumnParallelLinear`` (its ``gather_output`` is never needed by our models).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp_size {tp_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.output_size_per_partition = output_size // tp_size
        self.linear_method: LinearMethodBase = UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, input_size, self.output_size_per_partition, self.weight_loader
        )
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(self.output_size_per_partition)), self.weight_loader)
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the full checkpoint tensor (weight or bias) into ``param``."""
        n = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(ColumnParallelLinear):
    """``y = x W^T + b`` with the whole weight on every rank (vLLM: ``ReplicatedLinear``):
    an MoE router, whose ``(num_experts, hidden)`` scores every rank needs in full.

    Shapes: ``x`` (num_tokens, input_size) → ``y`` (num_tokens, output_size), on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_rank=0, tp_size=1)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one matrix.

    Used for ``gate_up_proj`` (``output_sizes=[intermediate, intermediate]``): one matmul
    instead of two. Each checkpoint tensor arrives with ``shard_id`` = its index in
    ``output_sizes`` and lands in its own row block. vLLM: ``MergedColumnParallelLinear``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index into output_sizes)")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one matrix, rows ``[q | k | v]``.

    Grouped-query attention: ``total_num_kv_heads`` may be smaller than
    ``total_num_heads``. When ``tp_size`` exceeds the number of KV heads, each KV head is
    replicated on ``tp_size // total_num_kv_heads`` ranks. Checkpoint tensors arrive with
    ``shard_id`` "q", "k" or "v". vLLM: ``QKVParallelLinear``.

    Output (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), per rank.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} attention heads are not divisible by tp_size {tp_size}")
        self.head_dim = head_dim
        self.num_heads = total_num_heads // tp_size
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(f"tp_size {tp_size} is not a multiple of the {total_num_kv_heads} KV heads")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            if total_num_kv_heads % tp_size:
                raise ValueError(f"{total_num_kv_heads} KV heads are not divisible by tp_size {tp_size}")
            self.num_kv_heads = total_num_kv_heads // tp_size
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        default_weight_loader(param.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split by input columns: each rank holds a slice of the input.

    Shapes: ``x`` (num_tokens, input_size // tp_size) → ``y`` (num_tokens, output_size).
    Each rank's product is a partial sum over its slice of the inputs; an all-reduce over the
    TP group makes it the full ``y`` on every rank, and the bias is added once, after it.
    vLLM: ``RowParallelLinear`` (``reduce_results=True``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.input_size_per_partition = input_size // tp_size
        self.linear_method: LinearMethodBase = UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, self.input_size_per_partition, output_size, self.weight_loader
        )
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(output_size)), default_weight_loader) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        n = self.input_size_per_partition
        default_weight_loader(param, loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        y = tensor_model_parallel_all_reduce(self.linear_method.apply(self, x))  # (num_tokens, output_size)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding table split by vocabulary rows across ranks.

    ``forward(input_ids (num_tokens,)) -> (num_tokens, embedding_dim)``. Rank r holds rows
    ``[r*n, (r+1)*n)`` (``n = ceil(vocab / tp_size)``; the last rank's tail is zero). With TP
    > 1 each rank looks up only the ids in its range, zeroes the rows of the others, and an
    all-reduce sums the ranks' rows: each token's row comes from exactly one rank. With one
    rank it is a plain lookup. vLLM: ``VocabParallelEmbedding`` (without its padding of the
    vocabulary to a multiple of 64).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        # As an LM head it is a linear too (vLLM: ``UnquantizedEmbeddingMethod``).
        self.linear_method: LinearMethodBase = UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, embedding_dim, self.num_embeddings_per_partition, self.weight_loader
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded_weight)
            return
        start = self.vocab_start_index
        rows = min(self.num_embeddings_per_partition, loaded_weight.shape[0] - start)
        param.data.zero_()  # the last rank's tail past the vocabulary stays zero
        default_weight_loader(param.data[:rows], loaded_weight.narrow(0, start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)  # (num_tokens,)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # (num_tokens, embedding_dim)
        rows = rows.masked_fill(outside[:, None], 0)
        return tensor_model_parallel_all_reduce(rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden)`` → ``(N, num_embeddings)`` float32 logits, on every rank.

        Each rank scores its own vocabulary slice; with TP > 1 the slices are all-gathered
        (rank order = vocabulary order) and the padding past the vocabulary is cut off, so
        every rank holds the same full logits and samples the same tokens. vLLM:
        ``LogitsProcessor`` with ``tensor_model_parallel_all_gather``.
        """
        logits = self.linear_method.apply(self, hidden)  # (N, vocab / tp)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits.float()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split by vocabulary rows like the embedding.

    Not called as a module: ``compute_logits`` multiplies by ``weight`` and all-gathers the
    per-rank logit slices. With tied embeddings the model uses the embedding itself (same
    slices, same ``compute_logits``). vLLM: ``ParallelLMHead``.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called; use the model's compute_logits")

"""The mixture-of-experts layer: a router, many SwiGLU experts, each token through its top k.

Mirrors vLLM's ``vllm/model_executor/layers/fused_moe/`` (``FusedMoE``, ``fused_topk``, the
modular kernel's prepare → experts → finalize) and the sparse blocks of its ``mixtral.py``,
``qwen2_moe.py`` and ``qwen3_moe.py``, written as a readable reference in plain torch. One MoE
layer, for ``T`` tokens of width ``H``, ``E`` experts and ``k`` experts per token::

    x (T, H) ─ router (gate) ─▶ logits (T, E) ─ fused_topk ─▶ topk_ids (T, k), topk_weights (T, k)
      │
      └▶ permute: the T·k (token, expert) slots sorted by expert, each slot a copy of its token's row
           ─▶ [expert parallelism: dispatch, all-to-all to the rank that holds the expert]
           ─▶ experts: for each expert e, its rows through down(silu(gate(x)) · up(x))
           ─▶ [expert parallelism: combine, all-to-all back to the rank the token came from]
      ◀── unpermute: each slot back to its token, times its weight, summed over its k slots (T, H)

Routing (``fused_topk``): a softmax over all ``E`` logits, the ``k`` largest kept and, with
``renormalize``, rescaled to sum to 1. Mixtral always renormalises — which is the same as a
softmax over the top-k logits alone; Qwen2-MoE and Qwen3-MoE do so when ``norm_topk_prob`` is
set. Qwen2-MoE adds a *shared expert*, a plain MLP every token goes through, scaled by
``sigmoid(shared_expert_gate(x))``, added to the routed experts' sum (``SparseMoeBlock``).

**Tensor parallelism** (``-tp``, without expert parallelism): every rank holds every expert,
each with its rank's slice of the intermediate dimension (vLLM's way): ``w13`` keeps rows
``[r·I/tp, (r+1)·I/tp)`` of gate and of up, ``w2`` the same columns. Each rank's result is a
partial sum over its slice, and one all-reduce after the combine makes it whole.

**Expert parallelism** (``--enable-expert-parallel``): the EP group is every worker of every
data-parallel engine (``EP size = DP × TP``, vLLM's rule); rank ``r`` holds experts
``[r·E/ep, (r+1)·E/ep)`` whole (no intermediate split). Attention stays data parallel: each
engine runs its own tokens. In each MoE layer every EP rank sends each slot's row to the
rank holding its expert (``dispatch``: one all-to-all of the counts, one of the rows), runs
its own experts on whatever arrived, and sends the results back (``combine``: one
all-to-all). Every rank must join every layer's all-to-alls, also one with no tokens — which
is why an idle data-parallel engine runs dummy batches while any other engine works. With TP
inside an engine, the TP ranks hold the same tokens, so each dispatches only its share
(``1/tp`` of the rows) and an all-reduce over the TP group puts the shares together.

Under ``torch.compile`` the routed part (routing, dispatch, experts, combine, all-reduce) is
one opaque op of the graph, ``glassbox::moe_forward`` (vLLM: ``torch.ops.vllm.moe_forward``):
its shapes depend on the routing, which a graph over an unbacked token count cannot trace.
The op finds its layer in the forward context, as the attention op does.

Each phase of a layer (router, dispatch, experts, combine) is entered through an observer the
worker sets (``MoEObserver``: ``engine/worker/moe_telemetry.py`` times it, counts the expert
load, and makes it a span when asked); this file imports nothing of the tracing.

Left out: fused kernels (Triton, oneDNN grouped GEMMs), grouped top-k and expert biases
(DeepSeek), expert load balancing (EPLB) and redundant experts, quantized experts, DeepEP /
pplx all-to-all kernels, expert placements other than contiguous ranges.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (
    get_ep_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from engine.model.forward_context import get_forward_context
from engine.model.layers import ReplicatedLinear, default_weight_loader

# ----------------------------------------------------------------------------- the glass


class MoEObserver(Protocol):
    """What watches the MoE layers (``engine/worker/moe_telemetry.py``; vLLM has none): the
    model runner sets one on every ``FusedMoE`` (``observer``), which enters each phase of a
    layer — ``router``, ``dispatch``, ``experts``, ``combine`` — through ``phase``. The context
    yields a dict the layer fills with the phase's figures (``num_tokens``, ``rows_sent``,
    ``rows_received``); the observer times the phase, its all-to-alls, and may make it a span.
    Without an observer the layer runs as it is."""

    def phase(self, name: str, layer_index: int) -> AbstractContextManager[dict[str, int]]: ...


# ----------------------------------------------------------------------------- routing


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights (vLLM: ``fused_topk``).

    Args:
        router_logits: ``(T, E)`` the router's scores, any float dtype.
        top_k: experts per token.
        renormalize: rescale the kept probabilities to sum to 1 (Mixtral; Qwen's
            ``norm_topk_prob``). Softmax-then-renormalise equals a softmax over the top-k logits.

    Returns:
        ``topk_weights`` ``(T, top_k)`` float32 and ``topk_ids`` ``(T, top_k)`` int64, best first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E) float32, as transformers
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # (T, k), (T, k)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


# ----------------------------------------------------------------------------- the layer


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer (vLLM: ``FusedMoE``).

    Parameters (vLLM's names), ``E_local = num_experts / ep_size`` experts on this rank:
        w13_weight: ``(E_local, 2 · I_local, H)``, rows ``[gate | up]`` of each expert
            (checkpoint ``w1``/``gate_proj`` and ``w3``/``up_proj``).
        w2_weight: ``(E_local, H, I_local)``, each expert's down projection (``w2``/``down_proj``).
    ``I_local = intermediate_size / tp`` without expert parallelism, ``intermediate_size`` with it.

    ``forward(hidden (T, H), router_logits (T, E)) -> (T, H)``: the routed experts' weighted
    sum, all-reduced over the TP group (the same on every TP rank).

    Args:
        num_experts: ``E``, experts in the whole layer.
        top_k: experts per token.
        hidden_size: ``H``.
        intermediate_size: ``I``, one expert's intermediate width (unsplit).
        renormalize: see ``fused_topk``.
        layer_index: the decoder layer's local index (how the compiled op finds this layer).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.layer_index = layer_index
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        ep = get_ep_group()
        self.ep_size, self.ep_rank = (ep.world_size, ep.rank_in_group) if ep is not None else (1, 0)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.ep_size} EP ranks")
        # With expert parallelism each rank holds whole experts; without, a slice of every one.
        self.moe_tp_size = 1 if self.ep_size > 1 else self.tp_size
        if intermediate_size % self.moe_tp_size:
            raise ValueError(
                f"intermediate size {intermediate_size} is not divisible by tp {self.moe_tp_size}"
            )
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = self.ep_rank * self.num_local_experts
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        i_local = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * i_local, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, i_local))
        for param, shards in ((self.w13_weight, 2), (self.w2_weight, 1)):
            param.weight_loader = self.weight_loader
            param.shards_needed = shards * self.num_local_experts  # checkpoint tensors that fill it
        # Rows this rank's experts took (E_local,), from every rank's tokens, summed since the
        # last read (``take_expert_load``): the load of this EP rank, engine-top's to show.
        self.expert_load = torch.zeros(self.num_local_experts, dtype=torch.int64, device="cpu")
        self.observer: MoEObserver | None = None

    # ------------------------------------------------------------------ loading

    @staticmethod
    def make_expert_params_mapping(
        ckpt_gate_proj_name: str, ckpt_down_proj_name: str, ckpt_up_proj_name: str, num_experts: int
    ) -> list[tuple[str, str, int, str]]:
        """``(param_fragment, checkpoint_fragment, expert_id, shard_id)`` for every expert's
        three checkpoint tensors (vLLM: ``FusedMoE.make_expert_params_mapping``): e.g.
        ``("experts.w13_", "experts.3.w1.", 3, "w1")``, which makes ``...experts.3.w1.weight``
        ``...experts.w13_weight``. Shard ids: ``w1`` gate, ``w3`` up (both into ``w13_weight``),
        ``w2`` down."""
        shards = (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name), ("w3", ckpt_up_proj_name))
        return [
            ("experts.w13_" if shard in ("w1", "w3") else "experts.w2_", f"experts.{e}.{name}.", e, shard)
            for e in range(num_experts)
            for shard, name in shards
        ]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Any, weight_name: str, shard_id: str, expert_id: int
    ) -> bool:
        """Copy one expert's checkpoint tensor into its place; False (nothing read) when another
        EP rank holds that expert.

        ``loaded_weight`` is ``(I, H)`` for ``w1``/``w3`` and ``(H, I)`` for ``w2``; with TP (no
        EP) only this rank's ``I/tp`` rows (columns for ``w2``) are read.

        Raises:
            ValueError: an unknown ``shard_id`` or a shape that does not fit.
        """
        local = expert_id - self.first_local_expert
        if not 0 <= local < self.num_local_experts:
            return False
        n = self.intermediate_size_per_partition
        start = (self.tp_rank if self.moe_tp_size > 1 else 0) * n
        if shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else n
            default_weight_loader(param.data[local].narrow(0, offset, n), loaded_weight.narrow(0, start, n))
        elif shard_id == "w2":
            default_weight_loader(param.data[local], loaded_weight.narrow(1, start, n))
        else:
            raise ValueError(f"{weight_name}: shard_id must be w1, w2 or w3, got {shard_id!r}")
        return True

    # ------------------------------------------------------------------ forward

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.glassbox.moe_forward(hidden, router_logits, self.layer_index)
        return self.forward_impl(hidden, router_logits)

    def forward_impl(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route, (dispatch,) run the experts, (combine,) all-reduce: ``(T, H)`` → ``(T, H)``."""
        with self._phase("router") as figures:
            topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)  # (T, k) each
            figures["num_tokens"] = hidden.shape[0]
        if self.ep_size == 1:
            out = self.routed_experts(hidden, topk_weights, topk_ids)  # (T, H) partial over TP slices
            return tensor_model_parallel_all_reduce(out)
        # Expert parallelism: the TP ranks hold the same tokens; each sends its share.
        num_tokens = hidden.shape[0]
        share = -(-num_tokens // self.tp_size)
        start, end = min(self.tp_rank * share, num_tokens), min((self.tp_rank + 1) * share, num_tokens)
        mine = self.routed_experts(hidden[start:end], topk_weights[start:end], topk_ids[start:end])
        if self.tp_size == 1:
            return mine
        out = hidden.new_zeros(num_tokens, self.hidden_size)  # (T, H): others' shares come by all-reduce
        out[start:end] = mine
        return tensor_model_parallel_all_reduce(out)

    def routed_experts(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The token → expert → combine path for this rank's tokens.

        Args:
            hidden: ``(T, H)``.
            topk_weights: ``(T, k)`` float32.
            topk_ids: ``(T, k)`` int64, expert ids of the whole layer.

        Returns:
            ``(T, H)`` in ``hidden``'s dtype: ``sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x_t)``.
        """
        num_tokens, k = topk_ids.shape
        # Permute: the T·k slots sorted by expert (stable: within an expert, token order).
        flat_ids = topk_ids.reshape(-1)  # (T·k,) the expert of each slot
        order = torch.argsort(flat_ids, stable=True)  # (T·k,) slot indices, grouped by expert
        rows = hidden[order // k]  # (T·k, H) each slot's token row, in expert order
        counts = torch.bincount(flat_ids, minlength=self.num_experts)  # (E,) slots per expert
        if self.ep_size == 1:
            self.expert_load += counts.cpu()
            with self._phase("experts"):
                out_rows = self.run_experts(rows, counts)  # (T·k, H)
        else:
            with self._phase("dispatch") as figures:
                received, received_counts, send_splits, recv_splits = self.dispatch(rows, counts)
                figures["rows_sent"], figures["rows_received"] = rows.shape[0], received.shape[0]
            self.expert_load += received_counts.sum(dim=0).cpu()
            with self._phase("experts"):
                expert_rows = self.run_local_experts(received, received_counts)  # (M, H)
            with self._phase("combine"):
                out_rows = self.combine(expert_rows, send_splits, recv_splits)  # (T·k, H)
        # Unpermute: each slot's result back in slot order, weighted, summed over its k slots.
        slots = torch.empty_like(out_rows)  # (T·k, H)
        slots[order] = out_rows
        weighted = (
            slots.view(num_tokens, k, self.hidden_size).float() * topk_weights[..., None]
        )  # (T, k, H) float32
        return weighted.sum(dim=1).to(hidden.dtype)  # (T, H)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` ``(N, H)`` grouped by local expert, ``counts`` ``(E_local,)`` rows of each,
        through their experts' SwiGLU: ``(N, H)``, same order."""
        out = torch.empty_like(rows)  # (N, H)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            x = rows[start : start + n]  # (n, H) the rows routed to expert e
            gate_up = F.linear(x, self.w13_weight[e])  # (n, 2 · I_local)
            gate, up = gate_up.chunk(2, dim=-1)  # (n, I_local) each
            out[start : start + n] = F.linear(F.silu(gate) * up, self.w2_weight[e])  # (n, H)
            start += n
        return out

    # ------------------------------------------------------------------ expert parallelism

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Send each row to the EP rank that holds its expert (vLLM: the prepare step of an
        all-to-all ``FusedMoEPrepareAndFinalize``).

        ``rows`` ``(N, H)`` are sorted by expert, and rank r holds experts
        ``[r·E_local, (r+1)·E_local)``, so the rows for rank r are one contiguous run. Two
        all-to-alls: the counts per expert (each rank learns how many rows of each of its
        experts every rank sends), then the rows.

        Returns:
            ``(received (M, H) grouped by source rank then expert, received_counts
            (ep, E_local), send_splits, recv_splits)`` (rows per rank, for the combine).
        """
        ep = get_ep_group()
        received_counts = ep.all_to_all_counts(counts)  # (ep · E_local,): from rank s, for my expert e
        received_counts = received_counts.view(self.ep_size, self.num_local_experts)  # (ep, E_local)
        send_splits = counts.view(self.ep_size, self.num_local_experts).sum(dim=1).tolist()  # rows per rank
        recv_splits = received_counts.sum(dim=1).tolist()
        received = ep.all_to_all(rows, send_splits, recv_splits)  # (M, H)
        return received, received_counts, send_splits, recv_splits

    def run_local_experts(self, received: torch.Tensor, received_counts: torch.Tensor) -> torch.Tensor:
        """The dispatched rows ``(M, H)``, grouped by source rank then expert, through this
        rank's experts: ``(M, H)`` in the same order."""
        local_ids = torch.arange(self.num_local_experts).repeat(self.ep_size)  # (ep · E_local,)
        expert_of_row = torch.repeat_interleave(local_ids, received_counts.reshape(-1))  # (M,)
        order = torch.argsort(expert_of_row.to(received.device), stable=True)  # (M,) by expert
        out_sorted = self.run_experts(received[order], received_counts.sum(dim=0))  # (M, H)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out

    def combine(self, out_rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send each expert output back to the rank its token came from (the reverse
        all-to-all, vLLM: the finalize step): ``(M, H)`` → ``(N, H)`` in the dispatch's order."""
        return get_ep_group().all_to_all(out_rows, recv_splits, send_splits)

    def _phase(self, name: str) -> AbstractContextManager[dict[str, int]]:
        """The observer's context for phase ``name`` of this layer; a no-op without one."""
        if self.observer is None:
            return contextlib.nullcontext({})
        return self.observer.phase(name, self.layer_index)

    def take_expert_load(self) -> torch.Tensor:
        """Rows this rank's experts took ``(E_local,)`` since the last call, and reset."""
        load, self.expert_load = self.expert_load, torch.zeros_like(self.expert_load)
        return load


# ----------------------------------------------------------------------------- the block


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE in place of its MLP: the router (``gate``), the routed experts
    and, for Qwen2-MoE, a shared expert with its sigmoid gate (vLLM: ``MixtralMoE``,
    ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``).

    ``forward(x (T, H)) -> (T, H)``, the same on every TP rank. Checkpoint names below the
    block: ``gate.weight`` ``(E, H)``; ``experts.<e>.<gate|up|down>`` (``FusedMoE``);
    ``shared_expert.*`` and ``shared_expert_gate.weight`` ``(1, H)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        layer_index: int,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # the router: every rank scores every expert
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, layer_index)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # (T, E)
        out = self.experts(x, router_logits)  # (T, H)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # (T, 1)
            out = out + gate * self.shared_expert(x)  # (T, H)
        return out


# ----------------------------------------------------------------------------- the compiled op


@torch.library.custom_op("glassbox::moe_forward", mutates_args=())
def moe_forward(hidden: torch.Tensor, router_logits: torch.Tensor, layer_index: int) -> torch.Tensor:
    """``FusedMoE.forward_impl`` of local layer ``layer_index`` as one op of a compiled graph
    (vLLM: ``torch.ops.vllm.moe_forward``): routing, dispatch, experts, combine and the TP
    all-reduce run eagerly, with the layer taken from the forward context. ``(T, H)``."""
    return get_forward_context().moe_layers[layer_index].forward_impl(hidden, router_logits)


@moe_forward.register_fake
def _(hidden: torch.Tensor, router_logits: torch.Tensor, layer_index: int) -> torch.Tensor:
    return torch.empty_like(hidden)


__all__ = ["FusedMoE", "MoEObserver", "SparseMoeBlock", "fused_topk", "moe_forward"]

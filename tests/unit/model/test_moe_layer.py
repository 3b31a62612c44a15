"""Mixture-of-experts models against transformers, and the MoE layer's own parts.

Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints (4 experts, 2 per token; Qwen3's
second layer dense through ``mlp_only_layers``; Qwen2's shared expert) run through the model
runner with chunked prefill beside decodes, eagerly and compiled (the MoE layer is one opaque
op of the graph), and must give transformers' greedy tokens token for token. Also: the
routing rules of each family, the expert-parallel weight split (each rank reads only its
experts) and the TP split of each expert.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.moe import FusedMoE, fused_topk
from tests.tiny_models import build_tiny_checkpoint, hf_greedy, hf_logits
from tests.unit.worker.test_model_runner import Driver, assert_matches_hf, make_runner, prompt

pytestmark = pytest.mark.usefixtures("eager")

MOE_KWARGS = {
    "mixtral": dict(num_layers=2),
    "qwen3_moe": dict(num_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen2_moe": dict(num_layers=2, norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: str(build_tiny_checkpoint(root / arch, arch, **kw)) for arch, kw in MOE_KWARGS.items()}


# ---------------------------------------------------------------------------- routing


def test_mixtral_routing_is_a_softmax_over_the_top_k_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5], [0.0, 3.0, 3.5, -2.0]])
    weights, ids = fused_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 3], [2, 1]]
    expected = torch.softmax(torch.gather(logits, 1, ids), dim=-1)
    assert torch.allclose(weights, expected)


def test_qwen_routing_without_norm_topk_prob_keeps_the_full_softmax_share():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5]])
    weights, ids = fused_topk(logits, 2, renormalize=False)
    full = torch.softmax(logits, dim=-1)
    assert torch.allclose(weights, full[0, [0, 3]][None])
    assert weights.sum() < 1.0  # the two experts' share of the whole softmax, not rescaled


# ---------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("arch", list(MOE_KWARGS))
def test_tiny_moe_checkpoints_have_clear_greedy_margins(moe_checkpoints, arch):
    for seed, n in ((1, 5), (12, 33)):
        ids = prompt(seed, n)
        logits = hf_logits(moe_checkpoints[arch], ids + hf_greedy(moe_checkpoints[arch], ids, 10))[n - 1 :]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        assert logits.softmax(-1).max(-1).values.mean() > 0.5


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("arch", list(MOE_KWARGS))
def test_moe_greedy_equals_transformers_under_chunked_prefill(moe_checkpoints, arch, compiled, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TORCH_COMPILE", "1" if compiled else "0")
    path = moe_checkpoints[arch]
    runner = make_runner(path)
    assert (runner.compiled is not None) == compiled
    assert sorted(runner.moe_layers) == ([0, 2] if arch == "qwen3_moe" else [0, 1])  # qwen3: layer 1 is dense
    driver = Driver(runner)
    driver.add("a", prompt(10, 7))
    driver.add("b", prompt(11, 12))
    driver.step({"a": 7, "b": 12})
    driver.add("long", prompt(12, 33))
    for chunk in (11, 13, 9):  # a prefill in chunks beside two decodes
        driver.step({"a": 1, "b": 1, "long": chunk})
    driver.decode(["a", "b", "long"], steps=6)
    driver.finish("a")
    driver.decode(["long"], steps=2)  # one token in the step
    assert_matches_hf(path, driver, ["b", "long"])
    if compiled:
        assert runner.compiled.num_graphs == 1
    load = sum(layer.take_expert_load() for layer in runner.moe_layers.values())
    assert int(load.sum()) > 0 and load.shape == (4,)


# ---------------------------------------------------------------------------- weight splits


def _expert_tensors(num_experts: int, hidden: int, inter: int) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return {
        (e, s): torch.randn(*shape, generator=g) for e in range(num_experts) for s, shape in shapes.items()
    }


def test_tp_ranks_hold_a_slice_of_every_expert_and_their_sum_is_the_whole_layer():
    tensors = _expert_tensors(4, 8, 6)
    x = torch.randn(5, 8)
    logits = torch.randn(5, 4)
    outs = []
    for tp_rank, tp_size in ((0, 1), (0, 2), (1, 2)):
        layer = FusedMoE(4, 2, 8, 6, renormalize=True)
        layer.tp_rank, layer.moe_tp_size = tp_rank, tp_size  # as a rank of a TP group of tp_size
        layer.intermediate_size_per_partition = 6 // tp_size
        layer.w13_weight = torch.nn.Parameter(torch.empty(4, 2 * (6 // tp_size), 8))
        layer.w2_weight = torch.nn.Parameter(torch.empty(4, 8, 6 // tp_size))
        for (e, shard), t in tensors.items():
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            assert layer.weight_loader(param, t, f"experts.{e}.{shard}", shard, e)
        outs.append(layer.forward_impl(x, logits))  # no TP group here: the partial sum
    assert torch.allclose(outs[1] + outs[2], outs[0], atol=1e-5)


def test_an_ep_rank_reads_only_its_own_experts():
    tensors = _expert_tensors(4, 8, 6)
    layer = FusedMoE(4, 2, 8, 6, renormalize=True)
    # As EP rank 1 of 2: experts 2 and 3, whole.
    layer.ep_size, layer.ep_rank, layer.num_local_experts, layer.first_local_expert = 2, 1, 2, 2
    layer.w13_weight = torch.nn.Parameter(torch.empty(2, 12, 8))
    layer.w2_weight = torch.nn.Parameter(torch.empty(2, 8, 6))
    loaded = {
        (e, s): layer.weight_loader(layer.w2_weight if s == "w2" else layer.w13_weight, t, "", s, e)
        for (e, s), t in tensors.items()
    }
    assert [e for (e, _), ok in loaded.items() if ok] == [2, 2, 2, 3, 3, 3]
    assert torch.equal(layer.w13_weight[1, :6], tensors[(3, "w1")])
    assert torch.equal(layer.w13_weight[1, 6:], tensors[(3, "w3")])
    assert torch.equal(layer.w2_weight[0], tensors[(2, "w2")])

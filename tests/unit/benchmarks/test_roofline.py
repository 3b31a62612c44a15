"""benchmarks/roofline.py's bound: the schedule of a workload and the arithmetic of each step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def roofline():
    spec = importlib.util.spec_from_file_location("roofline", REPO / "benchmarks" / "roofline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["roofline"] = module
    spec.loader.exec_module(module)
    return module


# hidden 2, one layer, one head of dim 2, one KV head, intermediate 2, vocab 4:
# linears 2·2·2 (q, o) + 2·2·2 (k, v) + 3·2·2 (gate, up, down) = 28, lm_head 8
TINY = dict(hidden_size=2, intermediate_size=2, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, vocab_size=4)  # fmt: skip


def test_model_cost_of_a_tiny_llama(roofline):
    cost = roofline.ModelCost.from_shape(TINY)
    assert (cost.linear_params, cost.lm_head_params) == (28, 8)
    assert cost.attention_flops_per_pair == 4 * 1 * 1 * 2
    assert cost.kv_entries_per_token == 2 * 1 * 1 * 2


def test_prefill_then_decode_exact_bound_one_compute_bound_one_memory_bound(roofline):
    cost = roofline.ModelCost.from_shape(TINY)
    steps = roofline.schedule([3], [2], max_num_batched_tokens=4, max_num_seqs=8)
    # step 1: the 3-token prompt (6 causal pairs, 3 KV entries read) samples output 1;
    # step 2: one decode at context 3 (3 + 1 pairs, 4 KV entries) samples output 2
    assert steps == [roofline.StepWork(tokens=3, requests=1, pairs=6, kv_read=3, prefill_tokens=3),
                     roofline.StepWork(tokens=1, requests=1, pairs=4, kv_read=4, prefill_tokens=0)]  # fmt: skip
    assert [s.flops(cost) for s in steps] == [2 * 28 * 3 + 2 * 8 + 8 * 6, 2 * 28 + 2 * 8 + 8 * 4]  # 232, 104
    assert [s.bytes(cost, 4) for s in steps] == [36 * 4 + 4 * 4 * 3, 36 * 4 + 4 * 4 * 4]  # 192, 208
    # 100 FLOP/s, 160 B/s: step 1 compute 2.32 s > memory 1.2 s; step 2 compute 1.04 s < memory 1.3 s
    bound = roofline.lower_bound(steps, cost, 4, flops_per_s=100, bytes_per_s=160, output_tokens=2)
    assert bound.seconds == pytest.approx(2.32 + 1.3)
    assert bound.out_tok_s == pytest.approx(2 / 3.62)
    assert (bound.compute_bound_steps, bound.steps) == (1, 2)
    # bfloat16 halves every byte: step 2 is compute-bound too (1.04 s > 0.65 s)
    half = roofline.lower_bound(steps, cost, 2, flops_per_s=100, bytes_per_s=160, output_tokens=2)
    assert half.seconds == pytest.approx(2.32 + 1.04)
    assert half.compute_bound_steps == 2


def test_schedule_chunks_a_long_prompt_and_runs_decodes_first(roofline):
    steps = roofline.schedule([5, 2], [1, 3], max_num_batched_tokens=4, max_num_seqs=8)
    # 1: 4 of prompt 0's 5 tokens (the budget); 2: its last token (samples its only output)
    # and prompt 1 whole; 3, 4: prompt 1's two decodes
    assert [(s.tokens, s.requests, s.pairs, s.kv_read, s.prefill_tokens) for s in steps] == [
        (4, 1, 10, 4, 4), (3, 2, 5 + 3, 5 + 2, 3), (1, 1, 3, 3, 0), (1, 1, 4, 4, 0)]  # fmt: skip


def test_schedule_admits_no_more_than_max_num_seqs(roofline):
    steps = roofline.schedule([1, 1, 1], [2, 2, 2], max_num_batched_tokens=100, max_num_seqs=2)
    assert [s.tokens for s in steps] == [2, 2, 1, 1]


def test_every_request_computes_its_prompt_and_all_but_its_last_output(roofline):
    prompts, out_lens = roofline.make_workload(32, 0, (32, 512), (32, 256))
    batched, seqs = roofline.default_budget()
    steps = roofline.schedule([len(p) for p in prompts], out_lens, batched, seqs)
    assert sum(s.tokens for s in steps) == sum(len(p) + n - 1 for p, n in zip(prompts, out_lens))
    assert max(s.tokens for s in steps) <= batched
    # 9320 prompt tokens (and the decodes of the first admitted) need three 4096-token steps
    assert sum(len(p) for p in prompts) == 9320
    assert [s.prefill_tokens > 0 for s in steps[:4]] == [True, True, True, False]
    assert all(s.prefill_tokens == 0 and s.tokens == s.requests for s in steps[3:])

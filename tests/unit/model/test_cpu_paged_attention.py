"""The C++ paged decode kernel (``--attention-backend CPU_PAGED_CPP``) against TORCH_SDPA's
gather + SDPA (``AttentionImpl.forward_decode``), on caches whose pages lie anywhere."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import Attention, AttentionMetadata
from engine.model.cpu import paged_attention_cpu
from engine.model.cpu.paged_attention_cpu import (
    cpp_kernel_unavailable,
    kernel_path,
    load_kernel,
    paged_decode_attention_cpu,
)

pytestmark = pytest.mark.skipif(cpp_kernel_unavailable() is not None, reason=str(cpp_kernel_unavailable()))

BS, DIM, NUM_BLOCKS = 16, 64, 300


def _case(nd: int, lens: list[int], heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    """A shuffled paged cache, a block table pointing anywhere in it, queries, and metadata."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BS, kv_heads, DIM, generator=g).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BS, kv_heads, DIM, generator=g).to(dtype)
    width = max(-(-n // BS) for n in lens) + 2  # some unused entries at the end of each row
    order = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1  # block 0 is the null block
    table = order[: nd * width].view(nd, width).int()
    q = torch.randn(nd, heads, DIM, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=nd, num_decodes=nd, slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32), seq_lens=seq_lens, block_table=table,
        query_start_loc_cpu=list(range(nd + 1)), seq_lens_cpu=list(lens),
        num_computed_tokens_cpu=[n - 1 for n in lens], max_decode_seq_len=max(lens), block_size=BS,
    )  # fmt: skip
    return q, k_cache, v_cache, meta


@pytest.fixture
def two_threads():
    """torch (and so the kernel) on 2 threads, whatever the machine: with 4 decodes a task
    takes a whole request, with 1 a single KV head."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


LENS_13 = [1, BS, 3 * BS + 5, 7, 2 * BS, 100, 1, 5 * BS - 1, 33, BS + 1, 250, 2, 64]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("lens", [[1], [BS], [3 * BS + 5], LENS_13], ids=["len1", "block", "blocks", "13"])
def test_matches_gather_and_sdpa(dtype, tol, heads, kv_heads, window, lens):
    q, k_cache, v_cache, meta = _case(len(lens), lens, heads, kv_heads, dtype)
    reference = Attention(heads, DIM, kv_heads, DIM**-0.5, sliding_window=window)
    with torch.inference_mode():
        expected = reference.impl.forward_decode(q, (k_cache, v_cache), meta)
        got = paged_decode_attention_cpu(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens, DIM**-0.5, window
        )
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads",
    [
        (24, 6, 2),  # the generic loop (not a multiple of 16)
        (128, 6, 2),  # AVX-512: 2 query heads per pass over the values, then 1
        (64, 6, 2),  # a group of 3 in one pass
        (64, 10, 2),  # a group of 5: a pass of 4, then 1
        (256, 4, 1),  # one head per pass, 4 passes
        (32, 8, 2),  # the bundled default model's head size
        (80, 6, 2),  # 5 registers a row
        (96, 4, 4),  # 6 registers a row, no grouping
    ],
)
@pytest.mark.parametrize("num_decodes", [1, 4])  # one KV head per task; a request's all per task
def test_other_head_sizes(head_dim, heads, kv_heads, num_decodes, two_threads):
    lens = [40, 1, 17, 3 * BS][:num_decodes]
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 30, BS, kv_heads, head_dim, generator=g)
    table = (torch.randperm(29, generator=g) + 1)[:16].view(4, 4).int()[:num_decodes]
    q = torch.randn(num_decodes, heads, head_dim, generator=g)
    meta = AttentionMetadata(
        num_reqs=num_decodes, num_decodes=num_decodes, slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.arange(num_decodes + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
        query_start_loc_cpu=list(range(num_decodes + 1)), seq_lens_cpu=lens,
        num_computed_tokens_cpu=[n - 1 for n in lens], max_decode_seq_len=max(lens), block_size=BS,
    )  # fmt: skip
    expected = Attention(heads, head_dim, kv_heads, 0.3).impl.forward_decode(q, (k_cache, v_cache), meta)
    got = paged_decode_attention_cpu(q, k_cache.contiguous(), v_cache.contiguous(), table, meta.seq_lens, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("lens", [[128], [300], [1000], [300, 7], [129, 700, 64]], ids=str)
def test_fewer_requests_than_threads_split_the_keys_and_match(dtype, tol, threads, window, lens):
    """Fewer decodes than threads: each request's keys are split between tasks (all KV heads
    each) and the partial softmaxes combined; the same numbers as the gather + SDPA, short
    requests (fewer keys than splits need) and a sliding window included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, meta = _case(len(lens), lens, 8, 4, dtype, seed=len(lens) * 7 + threads)
        reference = Attention(8, DIM, 4, DIM**-0.5, sliding_window=window)
        with torch.inference_mode():
            expected = reference.impl.forward_decode(q, (k_cache, v_cache), meta)
            got = paged_decode_attention_cpu(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, DIM**-0.5, window
            )
            peaked = (q.float() * 60).to(dtype)  # most exp(score - max) underflow in every split
            expected_peaked = reference.impl.forward_decode(
                peaked.float(), (k_cache.float(), v_cache.float()), meta
            )
            got_peaked = paged_decode_attention_cpu(
                peaked, k_cache, v_cache, meta.block_table, meta.seq_lens, DIM**-0.5, window
            )
    finally:
        torch.set_num_threads(before)
    assert (got.float() - expected.float()).abs().max().item() < tol
    assert torch.isfinite(got_peaked.float()).all()
    assert (got_peaked.float() - expected_peaked).abs().max().item() < max(tol, 1e-4)


def test_block_table_rows_of_a_larger_table():
    # The model runner passes meta.block_table[:nd]: rows of a wider table (a row stride).
    lens = [40, 17, 3]
    q, k_cache, v_cache, meta = _case(3, lens, 8, 4, torch.float32)
    wide = torch.zeros(5, 20, dtype=torch.int32)
    wide[:3, : meta.block_table.shape[1]] = meta.block_table
    ref = paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_table, meta.seq_lens, 0.125)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, wide[:3], meta.seq_lens, 0.125)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


# float32: scores of a few hundred carry ~1e-5 of rounding whatever the summation order
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_peaked_scores_softmax_underflows_to_zero_not_nan(dtype, tol):
    """Scores hundreds apart: most exp(score - max) underflow (the kernel's exp polynomial
    must give 0 there, not NaN or garbage), and the output is the top keys' values."""
    q, k_cache, v_cache, meta = _case(len(LENS_13), LENS_13, 8, 2, dtype, seed=3)
    q = (q.float() * 60).to(dtype)
    reference = Attention(8, DIM, 2, DIM**-0.5)
    with torch.inference_mode():
        expected = reference.impl.forward_decode(q.float(), (k_cache.float(), v_cache.float()), meta)
        got = paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_table, meta.seq_lens, DIM**-0.5)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - expected).abs().max().item() < tol


def test_malformed_inputs_raise():
    q, k_cache, v_cache, meta = _case(2, [20, 5], 8, 2, torch.float32)
    table, lens = meta.block_table, meta.seq_lens
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention_cpu(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), table, lens, 0.1)
    with pytest.raises(ValueError, match="not supported"):
        paged_decode_attention_cpu(q.half(), k_cache.half(), v_cache.half(), table, lens, 0.1)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_decode_attention_cpu(q, k_cache.bfloat16(), v_cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_cpu(q, k_cache, v_cache, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="KV heads must divide"):
        paged_decode_attention_cpu(q[:, :7].contiguous(), k_cache, v_cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="block_table row"):  # 20 keys need 2 blocks, the row has 1
        paged_decode_attention_cpu(q, k_cache, v_cache, table[:, :1], lens, 0.1)
    bad = table.clone()
    bad[0, 0] = NUM_BLOCKS  # one past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention_cpu(q, k_cache, v_cache, bad, lens, 0.1)


def test_one_openmp_runtime_and_cached_build():
    load_kernel()
    assert kernel_path().is_file()
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) == 1, f"two OpenMP runtimes loaded: {gomps}"


@pytest.mark.parametrize("task_shape", [1, paged_attention_cpu.NEVER], ids=["all-heads", "one-head"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_either_task_shape_gives_the_same_attention(task_shape, dtype, tol, two_threads):
    q, k_cache, v_cache, meta = _case(len(LENS_13), LENS_13, 8, 2, dtype)
    reference = Attention(8, DIM, 2, DIM**-0.5)
    with torch.inference_mode():
        expected = reference.impl.forward_decode(q, (k_cache, v_cache), meta)
        got = paged_decode_attention_cpu(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens, DIM**-0.5, task_shape=task_shape
        )
    assert (got.float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize(
    ("faster_from", "expect"), [(None, paged_attention_cpu.NEVER), (1, 1), (4, 4), (8, 8)]
)
def test_the_task_shape_follows_the_measurement(faster_from, expect, tmp_path, monkeypatch):
    from engine.model.cpu import measured_choice

    class Quiet:
        def others(self):
            return 0.0

    monkeypatch.setenv("GLASSBOX_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(measured_choice, "load_meter", Quiet)
    calls = []

    def fake(heads, kv_heads, head_dim, dtype, block_size, threads):
        calls.append(threads)
        return {n: {"per_head": 2.0 if faster_from and n >= faster_from else 1.0, "all_heads": 1.5}
                for n in paged_attention_cpu.TASK_SHAPE_DECODES_PER_THREAD}  # fmt: skip

    v = paged_attention_cpu.choose_task_shape(8, 2, 64, torch.float32, 16, 2, time_shapes=fake)
    assert v.data == {"all_heads_from": expect} and v.source == "measured"
    again = paged_attention_cpu.choose_task_shape(8, 2, 64, torch.float32, 16, 2, time_shapes=fake)
    assert again.source == "cached" and again.data == v.data and calls == [2]
    one = paged_attention_cpu.choose_task_shape(8, 1, 64, torch.float32, 16, 2, time_shapes=fake)
    assert one.source == "the only candidate"  # one KV head: both shapes are the same

"""The offline engine end to end: greedy output equals Hugging Face transformers.

Tiny random checkpoints (peaked logits, so greedy picks are not near-ties) are built with
transformers inside the test; transformers runs each prompt alone in float32 and is the
reference. Our engine runs all prompts together through the real scheduler, KV cache and
worker, under settings that force chunked prefill, prefix-cache hits and preemption. The
equivalence tests are model math over several families and run eagerly (the ``eager``
fixture; tests/e2e/test_parallel_shapes.py checks the compiled default against eager); the rest
run the defaults.
"""

from __future__ import annotations

import random
import time

import pytest
from tiny_models import build_tiny_checkpoint, hf_greedy

from engine import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    # Equivalence with transformers is about the model and the scheduler: run the engine in
    # this process (InprocClient); test_process_tree.py checks the tree gives the same tokens.
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """10 prompts of mixed lengths; two share a 40-token prefix, one is 32 tokens (block-aligned)."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, vocab) for _ in range(40)]
    lengths = [3, 7, 17, 33, 50, 64, 5, 90]
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
    prompts.append(shared + [rng.randrange(5, vocab) for _ in range(9)])
    prompts.append(shared + [rng.randrange(5, vocab) for _ in range(3)])
    return prompts


ARCHS = {
    "llama-gqa-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2-untied-bias": dict(arch="qwen2", tie_word_embeddings=False),
    "qwen3-qk-norm": dict(arch="qwen3", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory, default_model_dir):
    spec = ARCHS[request.param]
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), spec["arch"],
        tie_word_embeddings=spec["tie_word_embeddings"], tokenizer_dir=default_model_dir,
    )  # fmt: skip
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = _prompts(vocab)
    reference = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    # Ten 14-15 token prompts: one block each to start, a second block each to finish.
    rng = random.Random(1)
    short = [[rng.randrange(5, vocab) for _ in range(rng.choice((14, 15)))] for _ in range(10)]
    short_reference = [hf_greedy(path, p, MAX_NEW) for p in short]
    return path, prompts, reference, short, short_reference


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _run(path, prompts, max_model_len=256, **engine_kwargs):
    with LLM(str(path), max_model_len=max_model_len, **engine_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.engine_core.call_utility("get_scheduler_stats")
        kv = llm.engine_core.call_utility("get_kv_cache_info")
    return [list(o.outputs[0].token_ids) for o in outputs], stats, kv["num_free_blocks"], kv["num_blocks"]


def test_greedy_equals_transformers(checkpoint, eager):
    path, prompts, reference, _, _ = checkpoint
    got, stats, free, total = _run(path, prompts)
    assert got == reference
    # The two prompts with a shared 40-token prefix share its two full blocks.
    assert stats.prefix_cache_hits > 0
    assert free == total - 1, "every block is free again after all requests finished"


def test_greedy_equals_transformers_with_chunked_prefill(checkpoint, eager):
    path, prompts, reference, _, _ = checkpoint
    # A 16-token budget splits every prompt longer than 16 tokens over several steps.
    got, stats, _, _ = _run(path, prompts, max_num_batched_tokens=16, max_num_seqs=4)
    assert got == reference
    assert stats.step_counter > sum(len(p) for p in prompts) // 16


def test_greedy_equals_transformers_under_preemption(checkpoint, eager):
    path, _, _, prompts, reference = checkpoint
    # All ten requests are admitted with one block each; crossing 16 tokens each needs a
    # second block, but only 11 usable blocks exist: running requests are preempted
    # (recompute), resumed later, and must still produce the same tokens.
    got, stats, free, total = _run(path, prompts, max_model_len=128, num_gpu_blocks_override=12)
    assert stats.num_preemptions > 0
    assert got == reference
    assert free == total - 1


def test_block_aligned_prompt_sent_twice_hits_cache(tmp_path, default_model_dir):
    path = build_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True, tokenizer_dir=default_model_dir)
    prompt = list(range(10, 42))  # 32 tokens = exactly 2 blocks of 16
    reference = hf_greedy(path, prompt, MAX_NEW)
    with LLM(str(path), max_model_len=128) as llm:
        first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        second = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        stats = llm.engine_core.call_utility("get_scheduler_stats")
    assert list(first.outputs[0].token_ids) == reference
    assert list(second.outputs[0].token_ids) == reference
    # The whole prompt is cached, but the last token is always recomputed: the hit stops
    # one block short (16 of 32 tokens), never a full hit.
    assert second.num_cached_tokens == 16
    assert stats.prefix_cache_hits == 16


def test_seeded_sampling_is_reproducible(tmp_path, default_model_dir):
    path = build_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True, tokenizer_dir=default_model_dir)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 50))}]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    with LLM(str(path), max_model_len=128) as llm:
        a = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), max_model_len=128) as llm:
        c = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        other = llm.generate(
            prompts, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
        )
    assert a == b == c
    assert [o.outputs[0].token_ids for o in other] != a


def test_default_model_generates_text(default_model_dir):
    with LLM() as llm:
        out = llm.generate(["Once upon a time", "The engine"], SamplingParams(temperature=0, max_tokens=8))
        chat = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=8))
        n2 = llm.generate("Hi", SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=8, ignore_eos=True))[
            0
        ]
    assert [o.prompt for o in out] == ["Once upon a time", "The engine"]
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 8 for o in out)
    assert all(isinstance(o.outputs[0].text, str) for o in out)
    assert chat[0].finished and "Hello!" in chat[0].prompt
    assert [c.index for c in n2.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 for c in n2.outputs)


def test_step_delay_slows_every_engine_step_for_a_class(tiny_dir):
    """``--step-delay-ms`` (slow motion): each step sleeps that long after it ran."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_dir("llama")), max_model_len=64, step_delay_ms=60) as llm:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = llm.engine_core.engine_core.step_counter
    assert steps >= 6 and elapsed >= steps * 0.06

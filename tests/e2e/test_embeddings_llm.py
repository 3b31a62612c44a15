"""The offline pooling runner end to end: ``LLM.embed`` equals transformers' hidden states,
pooled the same way.

Tiny random checkpoints are built with transformers inside the test; transformers runs each
prompt alone in float32 (``AutoModel``'s ``last_hidden_state``, after the final norm) and is
the reference, pooled here (last token, mean, first token) and normalised. Our engine runs
all prompts together through the real scheduler, KV cache and worker: LAST pooling under a
16-token budget, so every long prompt is chunked and its vector comes from the last chunk;
MEAN and CLS with their prompts whole (the config turns chunked prefill off for them). The
equivalence tests are model math over several families and run eagerly (the ``eager``
fixture); one test runs the compiled default.
"""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine import LLM, PoolingParams, SamplingParams

MIN_COSINE = 0.9999


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (1, 5, 17, 40, 90)]


def hf_pooled(path, prompt: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    """Transformers' float32 final hidden states of one prompt, pooled as ``pooling`` says."""
    model = _hf_model(str(path))
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # (len, hidden)
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


@functools.lru_cache(maxsize=8)
def _hf_model(path: str) -> torch.nn.Module:
    import transformers

    return transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


ARCHS = {
    "llama-gqa-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2-untied-bias": dict(arch="qwen2", tie_word_embeddings=False),
    "qwen3-qk-norm": dict(arch="qwen3", tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory, default_model_dir):
    spec = ARCHS[request.param]
    return build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), spec["arch"],
                                 tie_word_embeddings=spec["tie_word_embeddings"], tokenizer_dir=default_model_dir)  # fmt: skip


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embedding_equals_transformers_pooled(checkpoint, pooling, eager):
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    # LAST: a 16-token budget chunks the 17-, 40- and 90-token prompts over several steps.
    budget = {"max_num_batched_tokens": 16, "max_num_seqs": 4} if pooling == "LAST" else {}
    with LLM(str(checkpoint), runner="pooling", max_model_len=128, pooler_config={"pooling_type": pooling},
             **budget) as llm:  # fmt: skip
        chunked = llm.config.scheduler_config.enable_chunked_prefill
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        raw = llm.encode([{"prompt_token_ids": prompts[-1]}], PoolingParams(use_activation=False),
                         pooling_task="embed", use_tqdm=False)[0]  # fmt: skip
        stats = llm.engine_core.call_utility("get_scheduler_stats")
        kv = llm.engine_core.call_utility("get_kv_cache_info")
    assert chunked == (pooling == "LAST")
    if pooling == "LAST":
        assert stats.step_counter > sum(len(p) for p in prompts) // 16, "the long prompts were chunked"
    for prompt, output in zip(prompts, outputs):
        embedding = np.array(output.outputs.embedding)
        assert output.prompt_token_ids == prompt and output.finished
        assert embedding.shape == (64,) and abs(np.linalg.norm(embedding) - 1) < 1e-5
        assert cosine(embedding, hf_pooled(checkpoint, prompt, pooling)) >= MIN_COSINE, len(prompt)
    # use_activation=False: the raw pooled hidden state, not normalised.
    reference = hf_pooled(checkpoint, prompts[-1], pooling, normalize=False)
    assert raw.outputs.data.dtype == np.float32
    assert cosine(raw.outputs.data, reference) >= MIN_COSINE
    assert np.linalg.norm(raw.outputs.data) == pytest.approx(np.linalg.norm(reference), rel=1e-3)
    assert kv["num_free_blocks"] == kv["num_blocks"] - 1, "no KV block is held after the requests finished"


def test_compiled_default_serves_pooling(tmp_path, default_model_dir):
    """The default engine (the compiled step) embeds a prompt longer than its chunk right."""
    path = build_tiny_checkpoint(tmp_path, "qwen3", tokenizer_dir=default_model_dir)
    prompts = [list(range(5, 75)), list(range(100, 103))]
    with LLM(str(path), runner="pooling", max_model_len=128, max_num_batched_tokens=32) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert cosine(output.outputs.embedding, hf_pooled(path, prompt, "LAST")) >= MIN_COSINE


def test_matryoshka_dimensions_cut_before_normalising(tmp_path, default_model_dir, eager):
    path = build_tiny_checkpoint(tmp_path, "llama", tokenizer_dir=default_model_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 64]}))
    prompt = list(range(20, 45))
    with LLM(str(path), runner="pooling", max_model_len=64) as llm:
        short = llm.embed([{"prompt_token_ids": prompt}], pooling_params=PoolingParams(dimensions=16),
                          use_tqdm=False)[0]  # fmt: skip
        with pytest.raises(ValueError, match=r"^dimensions must be one of \[16, 64\]"):
            llm.embed(
                [{"prompt_token_ids": prompt}], pooling_params=PoolingParams(dimensions=8), use_tqdm=False
            )
        # A pooling prompt may fill the context (no room is kept for an output token).
        full = llm.embed([{"prompt_token_ids": list(range(5, 69))}], use_tqdm=False)[0]
        with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
            llm.embed([{"prompt_token_ids": list(range(5, 70))}], use_tqdm=False)
    hidden = hf_pooled(path, prompt, "LAST", normalize=False)
    expected = hidden[:16] / np.linalg.norm(hidden[:16])
    assert len(short.outputs.embedding) == 16
    assert cosine(short.outputs.embedding, expected) >= MIN_COSINE
    assert len(full.outputs.embedding) == 64


def test_each_runner_refuses_the_others_methods(default_model_dir, eager):
    with LLM(str(default_model_dir), runner="pooling", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="only supported for generative models.*--runner pooling"):
            llm.generate(["hi"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="pooling_task required"):
            llm.encode(["hi"])
    with (
        LLM(str(default_model_dir), max_model_len=64) as llm,
        pytest.raises(ValueError, match="only supported for pooling models.*--runner generate"),
    ):
        llm.embed(["hi"])

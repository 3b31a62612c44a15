"""Mixture-of-experts models through the real process tree, on the default configuration.

- ``-tp 2``: each expert's intermediate dimension split over two workers, an all-reduce after
  the combine; greedy tokens equal transformers' (one prompt at a time, float32) for tiny
  Mixtral and Qwen3-MoE checkpoints, with prompts prefilled in chunks beside decodes.
- ``glassbox serve`` on a tiny Mixtral (compiled step, the default backend): a greedy
  completion over HTTP is transformers' text.
"""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (3, 20, 41)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tp2_moe_greedy_equals_transformers_under_chunked_prefill(tiny_dir, arch, monkeypatch, reap_children):
    path = tiny_dir(arch, num_heads=4, num_kv_heads=2, num_experts=4)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    # 16 tokens a step: the 20- and 41-token prompts are prefilled in chunks beside decodes.
    with LLM(str(path), max_model_len=128, tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, tiny_dir):
    from server_utils import start_server

    path = tiny_dir("mixtral", num_experts=4)
    server = start_server(
        tmp_path_factory.mktemp("moe_serve"), "--model", str(path), "--max-model-len", "128"
    )
    try:
        yield path, server
    finally:
        server.kill_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_moe_greedy_completion_is_transformers_text(moe_server):
    import httpx
    from tokenizers import Tokenizer

    path, server = moe_server
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = "Return the value"
    ids = tokenizer.encode(prompt).ids
    expected = tokenizer.decode(hf_greedy(path, ids, 12))
    body = {"model": str(path), "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected

"""The bundled default model loads in transformers, tokenizes any text, and is reproducible."""

from __future__ import annotations

import importlib.util
import json
import platform
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from engine.config import DEFAULT_MODEL, ModelConfig

MODEL_DIR = Path(DEFAULT_MODEL)
REPO = Path(__file__).resolve().parent.parent


def _read(name: str) -> dict:
    return json.loads((MODEL_DIR / name).read_text())


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_files_are_small_enough_to_ship():
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 20 * 1024 * 1024
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names


def test_config_shape(tokenizer):
    config = _read("config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] >= 32  # vLLM's attention kernels need head_dim >= 32
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0  # GQA groups
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["tie_word_embeddings"] is True


def test_engine_model_config_reads_it():
    mc = ModelConfig()
    assert (mc.architecture, mc.head_dim, mc.num_key_value_heads) == ("LlamaForCausalLM", 32, 4)
    assert (mc.max_model_len, mc.eos_token_id, mc.checkpoint_dtype) == (2048, 0, "float32")


def test_generation_config_stops_at_end_of_turn(tokenizer):
    eos = _read("generation_config.json")["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert tokenizer.eos_token_id in eos


def test_tokenizer_round_trips_any_text(tokenizer):
    for text in ["héllo 世界 🙂", "def f(x):\n\treturn x  # tabs, spaces\n", "", "\x00\x7f"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("Return the value.")[0] != 0  # no BOS is prepended
    assert len(tokenizer.encode("Return the value of the attribute.")) <= 8  # BPE merged common words


def test_chat_template_renders_a_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi!<|im_end|>\n"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi!\nassistant\n"


@torch.inference_mode()
def test_model_loads_and_greedy_output_depends_on_context(model, tokenizer):
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tokenizer.encode("The scheduler picks the next request")])
    probs = model(ids).logits[0].softmax(-1)  # (num_tokens, vocab_size)
    assert probs.max(-1).values.mean() > 0.05  # peaked: far from uniform (1/4096)
    changed = ids.clone()
    changed[0, 0] = tokenizer.encode(" zebra")[0]
    out_a = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    out_b = model.generate(changed, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert len(set(out_a.tolist())) > 1  # not one token repeated
    assert out_a.tolist() != out_b.tolist()  # the first prompt token matters


def test_tokenizer_is_reproducible(tmp_path):
    provenance = _read("provenance.json")
    if platform.python_version() != provenance["python"]:
        pytest.skip(f"the tokenizer was trained on Python {provenance['python']}'s standard library")
    spec = importlib.util.spec_from_file_location(
        "make_default_model", REPO / "scripts" / "make_default_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    made = script.write_tokenizer(tmp_path)
    assert made["corpus_sha256"] == provenance["corpus_sha256"]
    assert (tmp_path / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    assert (tmp_path / "tokenizer_config.json").read_bytes() == (
        MODEL_DIR / "tokenizer_config.json"
    ).read_bytes()

"""The bundled default model: loads in transformers, tokenizes any text, is reproducible, is trained.

The model card (``engine/assets/default_model/README.md``) states the held-out perplexity bound
and the greedy continuation checked here; ``scripts/train_default_model.py`` made the weights.
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL, ModelConfig

MODEL_DIR = Path(DEFAULT_MODEL)
REPO = Path(__file__).resolve().parents[3]

# The model card's numbers: the held-out perplexity bound and the greedy continuation.
HELDOUT_PERPLEXITY_BOUND = 120.0
GREEDY_PROMPT = "Return the"
GREEDY_CONTINUATION = " value for the given object, or None if the\ntarget object is not found."
CARD_PROMPTS = ["Return the", "The following", "This module"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    made = _script("make_default_model").write_tokenizer(tmp_path)
    assert made["corpus_sha256"] == provenance["corpus_sha256"]
    assert (tmp_path / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    assert (tmp_path / "tokenizer_config.json").read_bytes() == (
        MODEL_DIR / "tokenizer_config.json"
    ).read_bytes()


def test_heldout_perplexity_is_below_the_card_bound(model):
    """Recompute the held-out corpus from this interpreter's standard library and score a slice."""
    train = _script("train_default_model")
    _, heldout = train.corpus()
    ids = train.token_stream(train.load_tokenizer(MODEL_DIR), heldout)
    loss, count = train.heldout_loss(model, ids, train.TEST_TOKENS)
    assert count == train.TEST_TOKENS - 1
    assert math.exp(loss) < HELDOUT_PERPLEXITY_BOUND
    training = _read("provenance.json")["training"]
    if platform.python_version() == _read("provenance.json")["python"]:  # the very text it was scored on
        assert train.sha256(heldout) == training["heldout_sha256"]
        assert math.exp(loss) == pytest.approx(training["heldout_test_perplexity"], rel=1e-3)
    assert training["heldout_perplexity"] < HELDOUT_PERPLEXITY_BOUND


@pytest.fixture(scope="module")
def glassbox():
    with LLM(max_model_len=512) as llm:
        yield llm


def test_greedy_continuation_is_fixed_readable_text(glassbox):
    params = SamplingParams(temperature=0, max_tokens=18)
    out = glassbox.generate([GREEDY_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == GREEDY_CONTINUATION
    # It learned <|endoftext|> between documents, so a passage can end before max_tokens.
    ended = glassbox.generate(["This module"], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert ended[0].outputs[0].finish_reason == "stop"
    assert ended[0].outputs[0].text.endswith("Use find_spec() instead.")


def test_transformers_and_glassbox_agree_token_for_token(glassbox, tokenizer):
    from tiny_models import hf_greedy

    prompts = [tokenizer.encode(p) for p in CARD_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in glassbox.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    assert [list(t) for t in ours] == [hf_greedy(MODEL_DIR, p, 32) for p in prompts]


def test_readme_and_model_card_quote_the_real_greedy_continuation():
    """The sample the README and the card show is the one the test above pins (whitespace folded)."""

    def flat(text: str) -> str:
        return " ".join(text.split())

    shown = GREEDY_CONTINUATION.replace("\n", "\\n")  # the README writes the newline as \n
    expected = flat(f'`"{GREEDY_PROMPT}"` → `"{shown}"`')
    assert expected in flat((REPO / "README.md").read_text())
    assert str(HELDOUT_PERPLEXITY_BOUND).rstrip("0").rstrip(".") in (MODEL_DIR / "README.md").read_text()


def test_the_card_and_the_load_log_state_the_same_weights_and_say_what_they_measure():
    """The card gives the file's size; the worker's load line the same weights plus, on a CPU,
    the oneDNN-packed copies it keeps in memory (which once read as "30.5 MiB of weights")."""
    from engine.config import EngineConfig
    from engine.worker.model_runner import ModelRunner

    card = " ".join((MODEL_DIR / "README.md").read_text().split())
    size_mib = (MODEL_DIR / "model.safetensors").stat().st_size / 2**20
    runner = ModelRunner(EngineConfig(ModelConfig()), torch.device("cpu"), torch.float32)
    runner.load_model()
    weights = f"{runner.model_num_params / 1e6:.1f} M parameters, {size_mib:.1f} MiB of float32 weights"
    assert f"{weights}: the size of `model.safetensors`" in card
    line = runner.describe_model_memory()
    assert line.startswith(weights)
    if runner.model_packed_bytes:  # a CPU whose oneDNN packs the weights (this one, in CI)
        assert f"Loaded LlamaForCausalLM: {line}`" in card
        assert line.endswith(f"= {(runner.model_memory_usage) / 2**20:.1f} MiB in memory")

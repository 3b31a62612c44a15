"""The bundled tiny mixture of experts: small, loads in transformers, equals it, writes text, uses its experts.

The model card (``engine/assets/moe_model/README.md``) states the numbers checked here;
``scripts/train_moe_model.py`` made the weights from the default model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL, MOE_MODEL, MOE_SERVED_NAME, ModelConfig

MODEL_DIR = Path(MOE_MODEL)
REPO = Path(__file__).resolve().parents[3]

# The model card's numbers.
HELDOUT_PERPLEXITY_BOUND = 120.0
GREEDY_PROMPT = "The following"
CARD_PROMPTS = ["Return the", "The following", "This module"]


def _read(name: str) -> dict:
    return json.loads((MODEL_DIR / name).read_text())


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)


def test_files_are_small_and_share_the_default_models_tokenizer():
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 14 * 1024 * 1024
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (MODEL_DIR / name).read_bytes() == (Path(DEFAULT_MODEL) / name).read_bytes()


def test_config_is_a_qwen2_moe_of_four_experts_two_per_token():
    mc = ModelConfig(model=MOE_MODEL)
    assert (mc.architecture, mc.num_experts, mc.checkpoint_dtype) == ("Qwen2MoeForCausalLM", 4, "bfloat16")
    assert mc.hf_config["num_experts_per_tok"] == 2
    assert mc.served_model_name == MOE_SERVED_NAME
    dense = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())
    assert mc.hf_config["shared_expert_intermediate_size"] == dense["intermediate_size"]  # the dense MLP
    assert mc.expert_intermediate_size * mc.num_experts == dense["intermediate_size"]  # a quarter each


@torch.inference_mode()
def test_every_expert_of_every_layer_gets_tokens(hf_model, tokenizer):
    text = (REPO / "README.md").read_text()[:4000]
    ids = torch.tensor([tokenizer.encode(text)[:512]])
    router_logits = hf_model(ids, output_router_logits=True).router_logits  # per layer (T, E)
    for logits in router_logits:
        chosen = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4)
        assert (chosen / chosen.sum()).min() > 0.05, chosen  # the load-balancing loss did its work


def test_heldout_perplexity_is_below_the_card_bound():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train", REPO / "scripts" / "train_default_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()  # bfloat16, as shipped
    _, heldout = train.corpus()
    ids = train.token_stream(train.load_tokenizer(MODEL_DIR), heldout)
    loss, _ = train.heldout_loss(model, ids, train.TEST_TOKENS)
    assert math.exp(loss) < HELDOUT_PERPLEXITY_BOUND
    assert _read("provenance.json")["heldout_test_perplexity"] < HELDOUT_PERPLEXITY_BOUND


@pytest.fixture(scope="module")
def glassbox_f32():
    # float32 (upcast from the bfloat16 file), as transformers' reference runs.
    with LLM(MOE_MODEL, max_model_len=512, dtype="float32") as llm:
        yield llm


def test_transformers_and_glassbox_agree_token_for_token(glassbox_f32, tokenizer):
    from tiny_models import hf_greedy

    prompts = [tokenizer.encode(p) for p in CARD_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in glassbox_f32.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    assert [list(t) for t in ours] == [hf_greedy(MODEL_DIR, p, 32) for p in prompts]


def test_greedy_text_is_the_cards_readable_text(glassbox_f32):
    out = glassbox_f32.generate([GREEDY_PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    text = out[0].outputs[0].text
    card = " ".join((MODEL_DIR / "README.md").read_text().split())
    assert " ".join((GREEDY_PROMPT + text).split()) in card
    words = text.split()
    assert len(words) >= 8 and sum(w.isalpha() for w in words) >= len(words) // 2  # words, not noise

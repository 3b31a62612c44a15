"""Tiny random Llama-family checkpoints for tests, built with transformers' own classes.

``build_tiny_checkpoint`` writes a Hugging Face model directory (config.json and
model.safetensors, float32) in seconds; ``hf_greedy`` is the reference our engine must
match token for token.

The weights are random but *peaked*: the final norm's weight is scaled up so logits spread
widely (standard deviation about 13; the top token holds about 85 % of the probability).
The initialisation is wide enough that attention and MLP outputs are as large as the
embeddings, so the next token depends on the context (a test of attention, not only of the
embedding). On the test prompts the top-1 minus top-2 logit gap stays above 5e-3, while
two correct float32 implementations differ by about 1e-5 — greedy picks are never
near-ties (``test_tiny_checkpoints_have_clear_greedy_margins`` keeps this true).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import torch

# arch → (transformers config class, model class = architecture name, tied by default)
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", True),
    "mistral": ("MistralConfig", "MistralForCausalLM", False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", True),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", False),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")

# How much the final norm weight is scaled: logits' spread grows by this factor.
LOGIT_SCALE = 8.0
INITIALIZER_RANGE = 0.2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _special_token_id(tokenizer_dir: Path, name: str) -> int | None:
    """The id of ``eos_token``/``bos_token`` named in ``tokenizer_config.json``, if any."""
    from tokenizers import Tokenizer

    config_file = tokenizer_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    token = json.loads(config_file.read_text()).get(name)
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(token)


def build_tiny_checkpoint(
    path: str | Path,
    arch: str,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 512,
    sliding_window: int | None = None,
    rope_parameters: dict[str, Any] | None = None,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool = True,
    mlp_only_layers: list[int] | None = None,
    shared_expert_intermediate_size: int | None = None,
) -> Path:
    """Write a random float32 checkpoint of ``arch`` ("llama", "qwen2", "qwen3", "mistral",
    or a mixture of experts: "mixtral", "qwen2_moe", "qwen3_moe").

    MoE checkpoints have ``num_experts`` experts, ``num_experts_per_tok`` per token, each of
    ``moe_intermediate_size`` (Mixtral: ``intermediate_size``; default ``hidden_size``); Qwen's
    take ``norm_topk_prob`` and ``mlp_only_layers`` (dense layers), Qwen2-MoE a shared expert
    of ``shared_expert_intermediate_size`` (default ``2 * hidden_size``).

    ``tie_word_embeddings`` defaults to the family's usual choice (Llama 3.2 and Qwen3
    small models tie, Mistral and Qwen2-7B do not). ``sliding_window`` is set on Mistral
    as is, and on Qwen2/Qwen3 with ``use_sliding_window`` (every layer). With
    ``tokenizer_dir``, its tokenizer files are copied and its vocabulary size and EOS/BOS
    ids are used. Returns ``path``.
    """
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {', '.join(_ARCHS)}, got {arch!r}")
    config_name, model_name, tied_default = _ARCHS[arch]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    special: dict[str, int] = {}
    if tokenizer_dir is not None:
        from tokenizers import Tokenizer

        tokenizer_dir = Path(tokenizer_dir)
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, path / name)
        vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(
            with_added_tokens=True
        )
        for key in ("eos_token", "bos_token"):
            token_id = _special_token_id(tokenizer_dir, key)
            if token_id is not None:
                special[f"{key}_id"] = token_id

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied_default if tie_word_embeddings is None else tie_word_embeddings,
        initializer_range=INITIALIZER_RANGE,
        rms_norm_eps=1e-6,
        bos_token_id=special.get("bos_token_id", 1),
        eos_token_id=special.get("eos_token_id", 2),
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    if arch == "mixtral":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      intermediate_size=intermediate_size or moe_intermediate_size or hidden_size)  # fmt: skip
    elif arch in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      moe_intermediate_size=moe_intermediate_size or hidden_size, norm_topk_prob=norm_topk_prob,
                      mlp_only_layers=list(mlp_only_layers or []), decoder_sparse_step=1)  # fmt: skip
        if arch == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = shared_expert_intermediate_size or 2 * hidden_size
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs["use_sliding_window"] = sliding_window is not None
        kwargs["sliding_window"] = sliding_window
        kwargs["max_window_layers"] = 0
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [model_name]

    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
        for name, param in model.named_parameters():
            # Norm weights start at exactly 1 and biases at 0: jitter them so a loader
            # that drops them (or mixes q/k/v biases up) gives different tokens.
            if name.endswith("bias"):
                param.normal_(0.0, INITIALIZER_RANGE)
            elif "norm" in name and not name.startswith("model.norm"):
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.lru_cache(maxsize=16)
def _load_hf(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # generate() falls back to the model's own EOS when the call passes None; clear it here.
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_logits(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """Transformers' float32 logits ``(len(token_ids), vocab)`` for one sequence."""
    model = _load_hf(str(Path(path).resolve()))
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(path: str | Path, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation of one prompt: exactly ``max_new_tokens`` ids.

    The model is loaded once per path and cached for the process (paths are expected to be
    fresh temporary directories). float32, ``do_sample=False``. EOS is ignored explicitly: ``eos_token_id=None`` in the
    generation config stops nothing, and no processor forbids any token (``min_new_tokens``
    would forbid EOS and so change a greedy pick), matching our engine's ``ignore_eos``.
    """
    import transformers

    model = _load_hf(str(Path(path).resolve()))
    generation_config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        # An explicit all-ones mask: generate() would otherwise mask prompt tokens equal to
        # the pad id.
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
        )
    new_tokens = out[0, len(prompt_token_ids) :].tolist()
    assert len(new_tokens) == max_new_tokens, "transformers stopped early (EOS was not ignored)"
    return new_tokens

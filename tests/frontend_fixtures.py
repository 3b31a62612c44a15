"""A tiny byte-level BPE tokenizer and model directory, built on the spot for frontend tests.

The tokenizer is trained in milliseconds with the ``tokenizers`` library on a few lines of
text. Characters the training text lacks ("日本語", "👍", "ñ") stay split into one token per
UTF-8 byte, so tests get multi-byte characters spread over several tokens.
``build_model_dir`` adds a minimal Llama ``config.json`` (all ``ModelConfig`` reads) and,
optionally, a ``generation_config.json``. No weights: the frontend never needs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID = 0, 1
VOCAB_SIZE = 400  # the model's vocabulary; the tokenizer uses a little less, as real ones may

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TRAINING_TEXT = [
    "Hello world, this is a small corpus for a small tokenizer.",
    "The quick brown fox jumps over the lazy dog. The end.",
    "Café crème brûlée, 世界 and 🙂 are known here; stop STOP halt.",
    "numbers 12345 and more words, words, words ### done",
]


def build_tokenizer_dir(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Train and save a byte-level BPE tokenizer that adds BOS; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tokenizer.token_to_id(BOS) == BOS_ID and tokenizer.token_to_id(EOS) == EOS_ID
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def build_model_dir(
    path: Path,
    max_position_embeddings: int = 64,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """A model directory ``ModelConfig`` accepts: Llama config.json plus the tokenizer."""
    build_tokenizer_dir(path)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path

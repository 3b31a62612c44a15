"""Make the bundled default model's tokenizer, config files and initial weights.

The default model lets every command, test and tutorial run with no download: a tiny
Llama-architecture checkpoint in Hugging Face layout (about 16 MB, float32) that
transformers, Glassbox and vLLM all load. This script makes its tokenizer, its config files
and its *initial* (untrained, random) weights; ``scripts/train_default_model.py`` imports it,
trains those weights on the standard library's docstrings and documentation, and writes the
shipped ``engine/assets/default_model/`` (the trained ``model.safetensors``, ``provenance.json``).
To rebuild the shipped model run the training script, which runs this one's steps first; run
this one alone only for an untrained checkpoint (``--out DIR``) or the tokenizer.

What is made, and how (all reproducible: running this twice gives byte-identical
``model.safetensors`` and ``tokenizer.json`` with the same Python, torch and tokenizers):

- **Tokenizer**: byte-level BPE (vocabulary 4096, three special tokens first:
  ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2) trained with the
  ``tokenizers`` library on a corpus every Python install has: the docstrings of the
  top-level modules of the running interpreter's standard library (``<stdlib>/*.py``, files
  sorted by name; module, class and function docstrings in source order). A different Python
  patch release may change a docstring and so the vocabulary; ``provenance.json`` records
  the interpreter and the corpus's SHA-256. Byte-level BPE encodes any text (non-ASCII,
  emoji) without unknown tokens. No BOS token is added on encode (ChatML convention).
- **Chat template**: ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), in
  ``tokenizer_config.json``; ``tokenizer_class`` is ``PreTrainedTokenizerFast`` so
  transformers 4 and 5 both read it without a model-specific tokenizer class.
- **Model**: ``LlamaForCausalLM``, hidden 256, 4 layers, 8 query heads of head_dim 32 (vLLM's
  attention kernels want at least 32), 4 KV heads (GQA, and 8 and 4 both divide by 2 for
  ``-tp 2``), MLP 704, tied embeddings, 2048 positions: 4.0 M parameters. Initial weights
  (:func:`initial_model`) are drawn from one ``torch.Generator`` seeded with ``SEED``,
  parameter by parameter in the model's own order, with the usual GPT-2 scales for training
  from scratch: embeddings and linear layers N(0, 0.02²), the projections that write into
  the residual stream (``o_proj``, ``down_proj``) N(0, (0.02/√(2·layers))²), RMSNorm weights
  1. Saved with ``save_pretrained`` (safetensors).
- ``config.json`` and ``generation_config.json`` are written from the dicts below (not by
  ``save_pretrained``) so they read the same under transformers 4 and 5 (``rope_theta`` and
  ``torch_dtype`` at top level). ``generation_config.json`` lists both ``<|endoftext|>``
  and the end-of-turn ``<|im_end|>`` as EOS.

The model card (``README.md`` next to the weights) is written by hand, not by a script.

Usage::

    python scripts/train_default_model.py           # the shipped model: all of this, then training
    python scripts/make_default_model.py --out DIR  # an untrained checkpoint somewhere else
    python scripts/make_default_model.py --out DIR --tokenizer-only
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "engine" / "assets" / "default_model"

SEED = 0
VOCAB_SIZE = 4096
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

# Initial weight scales (see the module docstring).
INIT_STD = 0.02
RESIDUAL_OUT = ("o_proj", "down_proj")  # scaled by 1/sqrt(2 * num_hidden_layers)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": None,
    "torch_dtype": "float32",
    "use_cache": True,
}

GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": [0, 2],  # <|endoftext|>, and <|im_end|> ends a chat turn
    "pad_token_id": 0,
    "do_sample": False,
}

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,  # nothing is prepended on encode
    "eos_token": ENDOFTEXT,
    "pad_token": ENDOFTEXT,
    "unk_token": None,
    "additional_special_tokens": [IM_START, IM_END],
    "model_max_length": 2048,
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}


def stdlib_corpus_files() -> list[Path]:
    """The corpus files: the standard library's top-level ``*.py`` modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda p: p.name)


def stdlib_docstrings(files: list[Path]) -> list[str]:
    """Module, class and function docstrings of ``files``, in file and source order."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = []
    for path in files:
        tree = ast.parse(path.read_bytes(), filename=str(path))
        docs += [d for node in ast.walk(tree) if isinstance(node, kinds) if (d := ast.get_docstring(node))]
    return docs


def corpus_sha256(docs: list[str]) -> str:
    return hashlib.sha256("\n\n".join(docs).encode()).hexdigest()


def train_tokenizer(docs: list[str]) -> Tokenizer:
    """Byte-level BPE with ``VOCAB_SIZE`` entries, special tokens at ids 0..2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # no BOS/EOS added
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, f"{token} should have id {i}"
    return tokenizer


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer(out: Path) -> dict:
    """Train and write ``tokenizer.json`` and ``tokenizer_config.json``; returns provenance."""
    files = stdlib_corpus_files()
    docs = stdlib_docstrings(files)
    tokenizer = train_tokenizer(docs)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    return {
        "python": platform.python_version(),
        "corpus": "docstrings of <stdlib>/*.py, files sorted by name",
        "corpus_files": len(files),
        "corpus_docstrings": len(docs),
        "corpus_chars": sum(len(d) for d in docs),
        "corpus_sha256": corpus_sha256(docs),
        "vocab_size": tokenizer.get_vocab_size(),
    }


def write_configs(out: Path) -> None:
    """``config.json`` and ``generation_config.json`` from the dicts above (see module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", MODEL_CONFIG)
    write_json(out / "generation_config.json", GENERATION_CONFIG)


def initial_model():
    """The untrained ``LlamaForCausalLM``: seeded weights at the scales in the module docstring."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{k: v for k, v in MODEL_CONFIG.items() if k not in ("architectures", "torch_dtype")}
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED)
    residual_std = INIT_STD / (2 * config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        # named_parameters lists a tied weight once, so lm_head shares the embedding draw.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = residual_std if any(k in name for k in RESIDUAL_OUT) else INIT_STD
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "weights not tied"
    return model


def save_model(model, out: Path) -> None:
    """Write ``model.safetensors`` (float32) and our own config files (see module docstring)."""
    model.save_pretrained(str(out))
    (out / "model.safetensors").chmod(0o644)  # transformers 5 writes it owner-only
    write_configs(out)


def library_versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (required for weights)"
    )
    parser.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files")
    args = parser.parse_args(argv)
    out: Path = args.out
    if not args.tokenizer_only and out.resolve() == DEFAULT_OUT.resolve():
        print(
            f"{DEFAULT_OUT} ships trained weights: rebuild it with scripts/train_default_model.py "
            "(pass --out DIR here for an untrained checkpoint)",
            file=sys.stderr,
        )
        return 2
    provenance = write_tokenizer(out)
    if args.tokenizer_only:
        return 0
    save_model(initial_model(), out)
    provenance.update(seed=SEED, weights="initial (untrained)", **library_versions())
    write_json(out / "provenance.json", provenance)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({total / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Make the bundled default model in ``engine/assets/default_model/``.

The default model lets every command, test and tutorial run with no download: a tiny
Llama-architecture checkpoint in Hugging Face layout (about 16 MB, float32) that
transformers, Glassbox and vLLM all load. Its weights are random — it produces fluent-looking
nonsense — so it checks *mechanics* (scheduling, paging, sampling, streaming, greedy
equality with transformers), never quality. A trained default model is later work.

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
  attention kernels want at least 32), 4 KV heads (GQA), MLP 704, tied embeddings, 2048
  positions. Weights drawn from one ``torch.Generator`` seeded with ``SEED``, parameter by
  parameter in the model's own order: embeddings N(0, 0.05²), linear layers N(0, 0.08²),
  RMSNorm weights 1, except the final norm at 4.0. Those scales are chosen, not trained:
  they make the next-token distribution peaked (top-1 probability around 0.25, so greedy
  decoding is well defined) and make greedy output depend on the whole context (changing
  the first prompt token changes the continuation), which is what makes greedy-equality
  tests meaningful. Saved with ``save_pretrained`` (safetensors).
- ``config.json`` and ``generation_config.json`` are written from the dicts below (not by
  ``save_pretrained``) so they read the same under transformers 4 and 5 (``rope_theta`` and
  ``torch_dtype`` at top level). ``generation_config.json`` lists both ``<|endoftext|>``
  and the end-of-turn ``<|im_end|>`` as EOS.

Usage::

    python scripts/make_default_model.py            # writes engine/assets/default_model/
    python scripts/make_default_model.py --out DIR  # somewhere else
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

# Weight scales (see the module docstring for why these values).
EMBEDDING_STD = 0.05
LINEAR_STD = 0.08
FINAL_NORM_SCALE = 4.0

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


def write_model(out: Path) -> None:
    """Build the random-weight ``LlamaForCausalLM`` and write weights and configs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{k: v for k, v in MODEL_CONFIG.items() if k not in ("architectures", "torch_dtype")}
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        # named_parameters lists a tied weight once, so lm_head shares the embedding draw.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0)
            else:
                std = EMBEDDING_STD if "embed_tokens" in name else LINEAR_STD
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "weights not tied"
    model.save_pretrained(str(out))
    (out / "model.safetensors").chmod(0o644)  # transformers 5 writes it owner-only
    # Our own config files, identical under transformers 4 and 5 (see module docstring).
    write_json(out / "config.json", MODEL_CONFIG)
    write_json(out / "generation_config.json", GENERATION_CONFIG)


README = """\
# The bundled default model

A tiny Llama-architecture checkpoint (Hugging Face layout) so that Glassbox runs with no
download. **The weights are random**: output is fluent-looking nonsense. It exists to exercise
the engine's mechanics (scheduling, paged KV cache, sampling, streaming, greedy equality with
transformers), not to answer questions. A trained default model is later work.

Made by `scripts/make_default_model.py` (its docstring explains every choice); regenerate with

    python scripts/make_default_model.py

- `config.json`: LlamaForCausalLM, hidden 256, 4 layers, 8 heads of head_dim 32, 4 KV heads,
  MLP 704, vocabulary {vocab_size}, tied embeddings, 2048 positions, float32.
- `model.safetensors`: random weights, seed {seed}: embeddings N(0, {embedding_std}²), linear
  layers N(0, {linear_std}²), final norm weight {final_norm}, so that greedy decoding is peaked
  and depends on the whole context.
- `generation_config.json`: EOS ids 0 (`<|endoftext|>`) and 2 (`<|im_end|>`, end of a chat turn).
- `tokenizer.json`: byte-level BPE, {vocab_size} tokens; `<|endoftext|>` = 0, `<|im_start|>` = 1,
  `<|im_end|>` = 2; nothing is prepended on encode (no BOS).
- `tokenizer_config.json`: `PreTrainedTokenizerFast`, the special tokens, a ChatML chat template.
- `provenance.json`: the interpreter, library versions and corpus hash it was made with.

The tokenizer was trained on the docstrings of Python {python}'s standard library top-level
modules ({corpus_files} files, corpus SHA-256 `{corpus_sha256_short}…`). Another Python patch
release may differ in a docstring and so give a slightly different vocabulary; the shipped files
stay valid either way.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files")
    args = parser.parse_args(argv)
    out: Path = args.out
    provenance = write_tokenizer(out)
    if args.tokenizer_only:
        return 0
    write_model(out)
    import tokenizers
    import torch
    import transformers

    provenance.update(
        seed=SEED,
        torch=torch.__version__,
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
    )
    write_json(out / "provenance.json", provenance)
    (out / "README.md").write_text(
        README.format(
            vocab_size=VOCAB_SIZE,
            seed=SEED,
            embedding_std=EMBEDDING_STD,
            linear_std=LINEAR_STD,
            final_norm=FINAL_NORM_SCALE,
            python=provenance["python"],
            corpus_files=provenance["corpus_files"],
            corpus_sha256_short=provenance["corpus_sha256"][:16],
        )
    )
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({total / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

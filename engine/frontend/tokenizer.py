"""Load a checkpoint's tokenizer and render chat conversations — without torch.

Mirrors vLLM's ``vllm/transformers_utils/tokenizer.py`` (``get_tokenizer``) and the chat
rendering of ``vllm/entrypoints/chat_utils.py`` (``apply_hf_chat_template``). The API
server process must not import torch (ARCHITECTURE.md §3): in transformers 5,
``AutoTokenizer`` pulls torch in while ``PreTrainedTokenizerFast`` (a thin wrapper around
the Rust ``tokenizers`` library) does not, and a chat template is plain Jinja. A test checks
this in a fresh interpreter.

Left out: slow (SentencePiece/Python) tokenizers, ``trust_remote_code``, downloads from the
Hugging Face Hub, multimodal chat content, tool-call parsing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

# The file a fast tokenizer is built from; without it transformers would need the slow
# tokenizer (and sentencepiece) to convert one.
TOKENIZER_FILE = "tokenizer.json"
# The tokenizer's own length limit, set at load (transformers' value for "no limit").
# The engine's limit is max_model_len, checked by the input processor and the API server on
# every prompt; a checkpoint's model_max_length (often stale, or smaller than a
# --max-model-len that is fine for the model) would only make transformers log, for each
# long prompt we then refuse cleanly, that it "will result in indexing errors".
UNLIMITED_MODEL_MAX_LENGTH = int(1e30)


def get_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer stored in a local directory (never the network).

    Args:
        path: a directory holding ``tokenizer.json`` (and usually
            ``tokenizer_config.json``, ``special_tokens_map.json``, a chat template).

    Returns:
        A ``PreTrainedTokenizerFast``; ``tokenizer.backend_tokenizer`` is the Rust
        ``tokenizers.Tokenizer`` the detokenizer uses. Its ``model_max_length`` is
        unlimited: lengths are the engine's to check (``UNLIMITED_MODEL_MAX_LENGTH``).

    Raises:
        ValueError: the path is not a directory, has no ``tokenizer.json``, or the files
            cannot be loaded; the message names the path.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"tokenizer path {path!r} is not a directory")
    if not (directory / TOKENIZER_FILE).is_file():
        raise ValueError(
            f"no {TOKENIZER_FILE} in {str(directory)!r}: Glassbox loads fast tokenizers only "
            f"(a Hugging Face checkpoint saved with a fast tokenizer has this file)"
        )
    try:
        return PreTrainedTokenizerFast.from_pretrained(
            str(directory), local_files_only=True, model_max_length=UNLIMITED_MODEL_MAX_LENGTH
        )
    except Exception as e:  # transformers raises OSError, ValueError, JSON errors, ...
        raise ValueError(f"cannot load the tokenizer in {str(directory)!r}: {e}") from e


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> str:
    """Render a conversation to the prompt text the model was trained on.

    Args:
        tokenizer: the model's tokenizer; its ``chat_template`` is used unless
            ``chat_template`` is given.
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: end with the header that starts the assistant's turn.
        chat_template: a Jinja template that replaces the tokenizer's.

    Returns:
        The prompt text. It usually starts with the BOS token already, so tokenize it with
        ``add_special_tokens=False``.

    Raises:
        ValueError: no chat template anywhere, or the template failed (a template can
            refuse a conversation, e.g. roles that do not alternate).
    """
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer at {tokenizer.name_or_path!r} has no chat template; "
            "pass one (chat_template=... / --chat-template)"
        )
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template could not render these messages: {e}") from e
    assert isinstance(text, str)
    return text


def encode(tokenizer: PreTrainedTokenizerFast, text: str, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)``, refusing text that is not valid Unicode.

    Raises:
        ValueError: ``text`` holds a lone surrogate (JSON can carry one: ``"\\ud800"``),
            which no UTF-8 tokenizer can encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt is not valid Unicode text: {e.reason} at position {e.start}") from None
    return list(tokenizer.encode(text, **kwargs))

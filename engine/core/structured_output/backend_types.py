"""What a structured-output backend and its compiled grammars must offer.

Mirrors vLLM's ``vllm/v1/structured_output/backend_types.py``: ``StructuredOutputOptions``
(the kinds of constraint), ``StructuredOutputGrammar`` (one request's matcher state) and
``StructuredOutputBackend`` (compiles grammars, allocates the bitmask). Glassbox has one
backend, llguidance (``backend_guidance.py``); the interface stays so a reader sees where
vLLM's xgrammar, outlines and lm-format-enforcer backends plug in.

Bitmasks are numpy ``int32`` arrays, ``(rows, ceil(vocab_size / 32))``: bit ``j`` of word
``i`` allows token ``32 * i + j``. Deviation: vLLM keeps them in torch tensors; numpy keeps
this package torch-free, so the API server may import it to validate schemas.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import numpy as np


class StructuredOutputOptions(enum.Enum):
    """The kind of constraint a request carries (vLLM's ``StructuredOutputOptions``)."""

    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()


# (kind, its specification as text): what a grammar is compiled from.
StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputGrammar(ABC):
    """One request's compiled grammar and where its output is in it."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by the sampled ``tokens``; False when one of them breaks the grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, index: int, remaining_tokens: int) -> None:
        """Write row ``index`` of ``bitmask``: the tokens allowed next. ``remaining_tokens``:
        how many output tokens the request may still produce, this one included."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """An EOS id ended the output where the grammar allows it to end (vLLM's meaning): no
        more masking; the request finishes (``stop``)."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the grammar can no longer be followed, or None."""


class StructuredOutputBackend(ABC):
    """Compiles each request's constraint (vLLM's ``StructuredOutputBackend``)."""

    vocab_size: int

    @abstractmethod
    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str
    ) -> StructuredOutputGrammar:
        """Compile one constraint (in a worker thread of the manager).

        Raises:
            ValueError: the specification does not compile.
        """

    def allocate_token_bitmask(self, max_num_seqs: int) -> np.ndarray:
        """``(max_num_seqs, ceil(vocab_size / 32))`` int32, all bits set (every token allowed)."""
        return np.full((max_num_seqs, (self.vocab_size + 31) // 32), -1, dtype=np.int32)

    def destroy(self) -> None:  # noqa: B027 (optional: llguidance holds nothing to release)
        """Release what the backend holds (vLLM: ``destroy``)."""

"""A request's structured-output state: its constraint and its grammar, compiled or on the way.

Mirrors vLLM's ``vllm/v1/structured_output/request.py`` (``StructuredOutputRequest``). The
grammar starts as a ``Future`` (the manager compiles it in a thread pool); ``grammar`` is
None until it is done, then the grammar — or the exception that ended the compile, which
the scheduler turns into a finished request.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

from engine.core.structured_output.backend_types import StructuredOutputGrammar
from engine.sampling_params import SamplingParams, StructuredOutputsParams


@dataclasses.dataclass
class StructuredOutputRequest:
    """``params``: the constraint; ``_grammar``: a Future, the grammar, or the compile error.
    ``compile_started_at``: when compilation was submitted (``time.perf_counter()``, s)."""

    params: StructuredOutputsParams
    _grammar: Future | StructuredOutputGrammar | Exception | None = None
    compile_started_at: float = dataclasses.field(default_factory=time.perf_counter)

    @staticmethod
    def from_sampling_params(sampling_params: SamplingParams | None) -> StructuredOutputRequest | None:
        if sampling_params is None or sampling_params.structured_outputs is None:
            return None
        return StructuredOutputRequest(params=sampling_params.structured_outputs)

    def _check_grammar_completion(self) -> bool:
        if isinstance(self._grammar, Future):
            if not self._grammar.done():
                return False
            error = self._grammar.exception()
            self._grammar = error if error is not None else self._grammar.result()
        return self._grammar is not None

    @property
    def is_grammar_ready(self) -> bool:
        """The compile finished (with a grammar or an error)."""
        return self._check_grammar_completion()

    @property
    def grammar(self) -> StructuredOutputGrammar | Exception | None:
        """The grammar, the compile's exception, or None while it compiles."""
        if not self._check_grammar_completion():
            return None
        return self._grammar

    @grammar.setter
    def grammar(self, grammar: Future | StructuredOutputGrammar) -> None:
        self._grammar = grammar

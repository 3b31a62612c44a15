"""``StructuredOutputManager``: compiles each request's grammar and builds each step's bitmask.

Mirrors vLLM's ``vllm/v1/structured_output/__init__.py``. It lives in the engine core:

1. ``grammar_init`` (the engine core's ``add_request``): the request's constraint is compiled
   in a thread pool, off the busy loop; the request waits as ``WAITING_FOR_FSM`` and the
   scheduler passes over it until ``StructuredOutputRequest.grammar`` is ready.
2. ``grammar_bitmask`` (after ``schedule()``, in the engine core's step): one row per
   scheduled structured request that samples this step, ``(rows, ceil(vocab / 32))`` int32,
   row ``i`` for ``SchedulerOutput.structured_output_request_ids[i]``. It travels with the
   ``SchedulerOutput`` to the workers, whose ``ModelRunner`` sets every disallowed token's
   logit to -inf before sampling.
3. ``update_from_output`` (the scheduler) advances each grammar by its sampled tokens
   (``accept_tokens``); a grammar that is terminated finishes its request (``stop``).

Compile times (s) are kept for the metrics (``compile_time_histogram``, and
``take_compile_times`` for a benchmark), and each compile is a span
(``structured_output.compile_grammar``).

Left out: reasoning parsers (``should_fill_bitmask`` is always true), speculative tokens,
parallel bitmask filling for large batches (vLLM's threshold is 128 requests).
"""

from __future__ import annotations

import bisect
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.core.messages import GRAMMAR_COMPILE_BUCKETS
from engine.core.structured_output.backend_guidance import GuidanceBackend, get_structured_output_key
from engine.core.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from engine.logger import init_logger
from tracing import catalogue, stage
from tracing.propagation import attached_trace_context

if TYPE_CHECKING:
    from engine.sched.request import Request

logger = init_logger(__name__)


class StructuredOutputManager:
    """Engine-level manager for structured-output requests (vLLM's name).

    Args:
        structured_outputs_config: ``--structured-outputs-config``.
        load_tokenizer_json: returns the model's tokenizer as ``tokenizer.json`` text; called
            when the first structured request needs the backend (no cost to other servers).
        vocab_size: the model's vocabulary size (the logits' width).
        eos_token_ids: the model's EOS ids.
        max_num_seqs: rows to allocate for the bitmask.
    """

    def __init__(
        self,
        structured_outputs_config: Any,
        load_tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: list[int],
        max_num_seqs: int,
    ) -> None:
        self.config = structured_outputs_config
        self.load_tokenizer_json = load_tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._grammar_bitmask: np.ndarray | None = None
        # Grammar compiles are CPU-bound: at most half the cores (vLLM's choice).
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, (multiprocessing.cpu_count() + 1) // 2), thread_name_prefix="grammar-compile"
        )
        self._pending: set[Future] = set()
        self._compile_times: list[float] = []
        self._times_lock = threading.Lock()
        # Every compile since start: counts per GRAMMAR_COMPILE_BUCKETS bound (+ the rest), sum (s).
        self.compile_counts = [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
        self.compile_seconds_sum = 0.0

    def _get_backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (in a compile thread: it reads the whole vocabulary)."""
        with self._backend_lock:
            if self.backend is None:
                self.backend = GuidanceBackend(
                    self.load_tokenizer_json(), self.vocab_size, self.eos_token_ids, self.config
                )
            return self.backend

    def grammar_init(self, request: Request, trace_headers: dict[str, str] | None = None) -> None:
        """Start compiling ``request``'s grammar in the pool (no-op without a constraint).
        ``trace_headers``: the request's trace context (W3C), so that the compile's span is
        in the request's trace."""
        so_request = request.structured_output_request
        if so_request is None:
            return
        future = self.executor.submit(self._async_create_grammar, request, trace_headers)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        so_request.grammar = future

    def _async_create_grammar(
        self, request: Request, trace_headers: dict[str, str] | None
    ) -> StructuredOutputGrammar:
        so_request = request.structured_output_request
        assert so_request is not None
        request_type, spec = get_structured_output_key(so_request.params)
        start = time.perf_counter()
        attributes = {
            catalogue.ATTR_GEN_AI_REQUEST_ID: request.request_id,
            catalogue.ATTR_SO_KIND: so_request.params.kind,
        }
        with (
            attached_trace_context(trace_headers),
            stage(catalogue.STRUCTURED_OUTPUT_COMPILE_GRAMMAR, **attributes) as st,
        ):
            grammar = self._get_backend().compile_grammar(request_type, spec, so_request.params)
            seconds = time.perf_counter() - start
            st.set(catalogue.ATTR_SO_SHORTEST_OUTPUT, getattr(grammar, "shortest_output", None) or -1)
        with self._times_lock:
            self._compile_times.append(seconds)
            self.compile_counts[bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, seconds)] += 1
            self.compile_seconds_sum += seconds
        return grammar

    def compile_time_histogram(self) -> tuple[list[int], float]:
        """(counts per ``GRAMMAR_COMPILE_BUCKETS`` bound and one for the rest, sum of seconds)
        over every compile since start (for ``SchedulerStats``)."""
        with self._times_lock:
            return list(self.compile_counts), self.compile_seconds_sum

    def take_compile_times(self) -> list[float]:
        """Seconds of every grammar compile finished since the last call."""
        with self._times_lock:
            times, self._compile_times = self._compile_times, []
        return times

    @property
    def num_pending(self) -> int:
        """Grammars still compiling."""
        return len(self._pending)

    def wait_for_any_grammar(self, timeout_s: float) -> None:
        """Block until one compile finishes, or ``timeout_s`` passes (the busy loop's wait
        when every request is waiting for its grammar, instead of spinning empty steps)."""
        pending = list(self._pending)
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def grammar_bitmask(
        self, requests: dict[str, Request], structured_output_request_ids: list[str]
    ) -> np.ndarray | None:
        """The step's bitmask: row ``i`` allows the tokens ``structured_output_request_ids[i]``
        may sample next; ``(len(ids), ceil(vocab_size / 32))`` int32, or None for no id."""
        if not structured_output_request_ids:
            return None
        backend = self._get_backend()
        if self._grammar_bitmask is None:
            self._grammar_bitmask = backend.allocate_token_bitmask(self.max_num_seqs)
        bitmask = self._grammar_bitmask
        for index, request_id in enumerate(structured_output_request_ids):
            request = requests[request_id]
            grammar = request.structured_output_request.grammar
            assert isinstance(grammar, StructuredOutputGrammar), "scheduled before its grammar was ready"
            if grammar.is_terminated():
                bitmask[index].fill(-1)
                continue
            grammar.fill_bitmask(bitmask, index, request.max_tokens - request.num_output_tokens)
            if grammar.error() is not None:
                # Nothing can follow: let any token through; the grammar refuses it after
                # sampling and the request finishes with an error (never a row of all -inf).
                bitmask[index].fill(-1)
        return bitmask[: len(structured_output_request_ids)].copy()

    def should_advance(self, request: Request) -> bool:
        """Whether the request's sampled tokens advance a grammar (vLLM: reasoning aside, yes)."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        """Stop the compile threads (the engine core's shutdown)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            self.backend.destroy()

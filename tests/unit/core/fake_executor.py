"""``FakeExecutor``: the executor boundary with no model behind it, for engine-core tests.

In the spirit of vLLM's engine-core tests (``tests/v1/engine/test_engine_core.py``, which
subclass the executor): the part under test is the engine core — the real ``Scheduler``, KV
cache manager and output building — and only the workers are replaced. ``execute_model``
keeps a mirror of each request as a model runner does (new requests arrive whole, later
steps send deltas, a resumed request its tokens so far) and "samples" a scripted token
whenever a request's prompt and earlier outputs are all computed:

    token = token_fn(request_id, position)     position: 0 for the first output token

so a test knows every token the engine core must hand out, in order, even across a
preemption (the recomputed request picks up at its next position). It can also be told to
sample a request's EOS at a chosen position, to fail at a chosen step, or to pause inside a
chosen step until the test lets it go on (to act while a request is mid-flight, without a
sleep). A pooling request (``pooling_params``) samples nothing: the step that completes its
prompt returns its "vector", ``[sum of its prompt ids, prompt length]``, as a pooler output.
Each KV block costs ``bytes_per_block`` of a one-layer float32 page; the budget it
reports holds ``NUM_BLOCKS`` blocks (``--num-gpu-blocks-override`` sets a smaller one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from engine.executor.abstract import Executor
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.outputs import Float32Tensor, ModelRunnerOutput
from engine.sched.output import SchedulerOutput

NUM_BLOCKS = 128  # what the fake worker's KV budget holds, unless the config overrides it
PAUSE_DEADLINE_S = 60.0  # a paused step nobody resumes fails instead of hanging the test


def default_token(request_id: str, position: int) -> int:
    """Token 1000 + 100·k + position, k (0..49) from the request id: over their first 100
    positions, requests with different k share no token."""
    return 1000 + 100 * (sum(map(ord, request_id)) % 50) + position


class FakeExecutor(Executor):
    """An ``Executor`` (``engine/executor/abstract.py``) with one fake worker; see the
    module docstring. ``EngineCore(config, executor_class=FakeExecutor)`` builds it.

    Attributes a test sets (on ``engine.model_executor``, before the step they affect):
        token_fn: ``(request_id, position) -> token id`` for every sampled token.
        eos_at: request id → the output position at which its EOS is sampled instead.
        fail_at_step: the ``execute_model`` call (1-based) that raises ``error``.
        pause_at_step: the ``execute_model`` call that sets ``paused`` and waits for
            ``resume`` (at most ``PAUSE_DEADLINE_S``) before it computes anything.

    What it records: ``num_steps`` (``execute_model`` calls), ``requests`` (the requests
    the "worker" holds: id → its tokens so far), ``shut_down``.
    """

    def _init_executor(self) -> None:
        self.device_info = {"device": "fake", "dtype": "float32"}
        self.token_fn: Callable[[str, int], int] = default_token
        self.eos_at: dict[str, int] = {}
        self.fail_at_step: int | None = None
        self.error: BaseException = RuntimeError("the fake worker failed in execute_model")
        self.pause_at_step: int | None = None
        self.paused, self.resume = threading.Event(), threading.Event()
        self.num_steps = 0
        self.requests: dict[str, list[int]] = {}
        self._prompt_lens: dict[str, int] = {}
        self._eos_token_ids: dict[str, int | None] = {}
        self._pooling: set[str] = set()
        self.shut_down = False
        self.failure_callback: Callable[[BaseException], None] | None = None
        self.spec = FullAttentionSpec(
            block_size=self.config.cache_config.block_size,
            num_kv_heads=1,
            head_size=8,
            dtype_size=4,
            num_layers=1,
        )

    # ------------------------------------------------------------------ start-up

    def get_kv_cache_specs(self) -> list[FullAttentionSpec]:
        return [self.spec]

    def determine_available_memory(self) -> list[int]:
        return [NUM_BLOCKS * self.spec.bytes_per_block]

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        self.kv_cache_configs = kv_cache_configs

    # ------------------------------------------------------------------ steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.num_steps == self.pause_at_step:
            self.paused.set()
            if not self.resume.wait(PAUSE_DEADLINE_S):
                raise TimeoutError(f"step {self.num_steps} paused and never resumed")
        if self.num_steps == self.fail_at_step:
            raise self.error
        for req_id in scheduler_output.finished_req_ids:  # the worker forgets them
            for state in (self.requests, self._prompt_lens, self._eos_token_ids):
                state.pop(req_id, None)
            self._pooling.discard(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            if new.pooling_params is not None:
                self._pooling.add(new.req_id)
            self.requests[new.req_id] = list(new.prompt_token_ids)
            self._prompt_lens[new.req_id] = len(new.prompt_token_ids)
            self._eos_token_ids[new.req_id] = new.eos_token_id
        cached = scheduler_output.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:  # recomputed from 0: all its tokens come again
                self.requests[req_id] = list(cached.resumed_req_token_ids[i])
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        pooled: list[Float32Tensor | None] = []
        for req_id in req_ids:
            tokens = self.requests[req_id]  # a KeyError: the engine core lost a request's state
            done = computed[req_id] + scheduler_output.num_scheduled_tokens[req_id] >= len(tokens)
            pooled.append(_vector(tokens) if done and req_id in self._pooling else None)
            if not done or req_id in self._pooling:
                sampled.append([])  # a prefill chunk that leaves part of the prompt for later, or pooling
                continue
            position = len(tokens) - self._prompt_lens[req_id]
            if self.eos_at.get(req_id) == position:
                token = self._eos_token_ids[req_id]
            else:
                token = self.token_fn(req_id, position)
            tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            pooler_output=pooled if self._pooling else [],
        )  # fmt: skip

    # ------------------------------------------------------------------ the other worker calls

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """The one fake worker's answer to ``method`` (those the engine core calls)."""
        answers = {
            "check_health": None,
            "execute_dummy_batch": None,
            "get_comm_stats": {"execute_model_s": 0.0},
        }
        if method not in answers:
            raise AttributeError(f"the fake worker has no method {method!r}")
        return [answers[method]]

    def die(self, error: BaseException) -> None:
        """A worker died while the engine was idle: report it as a worker process's
        executor does (through the failure callback, from another thread)."""
        assert self.failure_callback is not None, "no engine core registered a failure callback"
        self.failure_callback(error)

    def shutdown(self) -> None:
        self.shut_down = True


def _vector(prompt: list[int]) -> Float32Tensor:
    """The fake pooler's vector of a prompt: its ids' sum and its length."""
    import numpy as np

    return Float32Tensor.from_numpy(np.array([sum(prompt), len(prompt)], dtype=np.float32))

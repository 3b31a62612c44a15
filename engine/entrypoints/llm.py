"""``LLM``: the offline API — give it prompts, get ``RequestOutput``s back.

Mirrors vLLM's ``vllm/entrypoints/llm.py``. The pieces are the same ones the API server
uses: ``InputProcessor`` (tokenize, validate) → engine core client (add, outputs, abort)
→ ``OutputProcessor`` (detokenize, stop strings, gather ``n`` children). The engine core
runs in its own process (``SyncMPClient``), or in the caller's with
``GLASSBOX_ENABLE_MULTIPROCESSING=0`` (``InprocClient``).

Example::

    from engine import LLM, SamplingParams
    llm = LLM()                       # the bundled tiny model
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)

A model run with ``runner="pooling"`` embeds instead (``embed``, ``encode``; vLLM 0.32's
``LLM`` methods): ``LLM(runner="pooling").embed(["Once upon a time"])[0].outputs.embedding``.
Each method refuses the other runner's model, naming the runner it needs.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine import envs
from engine.config import ConfigError
from engine.distributed import topology
from engine.engine_args import EngineArgs, drop_vllm_compat_kwargs
from engine.frontend.core_client import EngineCoreClient, InprocClient
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_processor import OutputProcessor, ParentRequest
from engine.frontend.outputs import EmbeddingRequestOutput, PoolingRequestOutput, PromptType, RequestOutput
from engine.frontend.tokenizer import apply_chat_template, get_tokenizer
from engine.logger import init_logger
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.tasks import PoolingTask
from engine.utils import run_dir as run_dirs
from engine.utils.process_harness import Observability, ProcessSpec, start_observability
from tracing import catalogue, get_handle, stage
from tracing.stage import startup_trace
from tracing.telemetry.collector import Recorder
from tracing.telemetry.publisher import stop_telemetry

logger = init_logger(__name__)

# A step that schedules nothing while requests wait means they can never run; this many in
# a row turns a would-be hang into an error.
MAX_IDLE_STEPS = 100


class LLM:
    """An engine for offline batch inference.

    Args:
        model: local Hugging Face model directory (default: the bundled tiny model).
        **kwargs: any ``EngineArgs`` field, by its Python name (``max_model_len=512``,
            ``num_gpu_blocks_override=64``, ``enable_prefix_caching=False``,
            ``generation_config="vllm"``, ``chat_template=...``, ...). vLLM keywords for
            what Glassbox leaves out (``quantization=...``) raise ``ConfigError``; a few
            that change nothing (``download_dir=...``) are accepted with a logged note.

    Raises:
        ConfigError (a ValueError): a bad argument; the message names the flag.
        ValueError: the KV cache cannot hold one ``max_model_len`` request.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        engine_args = EngineArgs(**drop_vllm_compat_kwargs(kwargs))
        self.config = engine_args.create_engine_config(usage_context="llm")
        # Every process this LLM owns (itself first), named once, before anything starts.
        self.topology = topology.plan(self.config, multiprocess=envs.GLASSBOX_ENABLE_MULTIPROCESSING)
        obs = self.config.observability_config
        try:
            self.topology.check_fault_targets(obs.inject_fault)
        except ValueError as e:
            flag = "--inject-fault" if engine_args.inject_fault else "GLASSBOX_FAULT"
            raise ConfigError(flag, obs.inject_fault, str(e)) from None
        self.run_dir = run_dirs.create_run_dir()
        self._closed = False
        obs = self.config.observability_config
        # inject_fault= (--inject-fault): in GLASSBOX_FAULT while this LLM starts its processes,
        # so each inherits it (setting up tracing arms it here too); then as it was.
        restore_fault_env = _set_fault_env(obs.inject_fault if engine_args.inject_fault else None)
        previous = get_handle()
        # A test that collects spans in memory keeps doing so across engines.
        in_memory = previous is not None and previous.in_memory is not None
        # Tracing (and the owner's status file), SIGUSR1 stack dumps (glassbox doctor) and live
        # telemetry of this process (the owner): engine-top sees llm.init as it runs.
        owner = ProcessSpec(self.topology.owner.name, self.run_dir,
                            observability=Observability.of(obs, in_memory=in_memory))  # fmt: skip
        self.tracing, self.telemetry = start_observability(owner)
        self.recorder: Recorder | None = None
        try:
            with (
                startup_trace(),
                stage(
                    catalogue.LLM_INIT,
                    **{catalogue.ATTR_MODEL_NAME: self.config.model_config.served_model_name},
                ),
            ):
                multiprocess = envs.GLASSBOX_ENABLE_MULTIPROCESSING
                run_dirs.write_manifest(self.run_dir, model=self.config.model_config.served_model_name,
                                        **run_dirs.plan_tree(self.topology))  # fmt: skip
                if obs.telemetry_record:
                    self.recorder = Recorder().start(self.run_dir, obs.telemetry_record)
                self.tokenizer = get_tokenizer(self.config.model_config.tokenizer)
                if self.config.model_config.chat_template is not None:  # --chat-template / chat_template=
                    self.tokenizer.chat_template = self.config.model_config.chat_template
                self.input_processor = InputProcessor(
                    self.config.model_config,
                    self.tokenizer,
                    self.config.parallel_config.data_parallel_size,
                    self.config.structured_outputs_config,
                )
                self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
                self.engine_core = EngineCoreClient.make_client(self.config, self.run_dir, multiprocess)
                self._init_stats_log()
        except BaseException as e:
            restore_fault_env()
            _stop_telemetry(self.recorder)
            # A bad setting, Ctrl-C or SystemExit is no failure to keep a post-mortem of.
            quiet = isinstance(e, ConfigError) or not isinstance(e, Exception)
            run_dirs.close_run_dir(self.run_dir, failure=None if quiet else f"LLM start-up failed: {type(e).__name__}",
                                   root_cause=getattr(e, "root_cause", None) or f"{type(e).__name__}: {e}",
                                   telemetry_record=obs.telemetry_record)  # fmt: skip
            raise
        restore_fault_env()
        if self.telemetry is not None and isinstance(self.engine_core, InprocClient):
            # The engine core runs here: its scheduler and KV-cache gauges too.
            self.telemetry.add_gauge_provider(self.engine_core.engine_core.telemetry_gauges)
            self.telemetry.set_requests_provider(self.engine_core.engine_core.telemetry_requests)
        # Stops the tree and removes the run directory at shutdown(), when the LLM is
        # garbage-collected, or at interpreter exit — whichever comes first.
        self._finalizer = weakref.finalize(
            self, _shutdown_engine, self.engine_core, self.run_dir, self.recorder
        )
        self.request_counter = itertools.count()
        # Logs, once, the sampling defaults taken from the model's generation_config.json.
        if self.config.model_config.runner_type == "generate":
            self.config.model_config.get_diff_sampling_param()

    # ----------------------------------------------------------------- public API

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's: the sampling fields of its
        ``generation_config.json`` (``max_new_tokens`` → ``max_tokens``; ``do_sample`` is
        ignored, as in vLLM), per ``generation_config=`` ("auto", "vllm" or a directory)."""
        return SamplingParams.from_defaults(self.config.model_config.get_diff_sampling_param())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[[int, int], None] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; returns one ``RequestOutput`` per prompt, in order.

        Args:
            prompts: a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}``, or a list.
            sampling_params: one for all prompts or one per prompt (default:
                ``get_default_sampling_params()``).
            use_tqdm: show a progress bar on a terminal; or a callable ``(done, total)``.
            priority: per-prompt priority (lower runs first under ``--scheduling-policy priority``).

        Raises:
            ValueError: a prompt that leaves no room for output (``max_model_len`` tokens or
                more: the API server's rule, ``validate_prompt``), a bad token id, or a
                mismatched number of sampling params; nothing is queued in that case.
        """
        self._check_open()
        runner_type = self.config.model_config.runner_type
        if runner_type != "generate":
            raise ValueError(
                "LLM.generate() is only supported for generative models. This one runs with --runner "
                f"{runner_type}: pass runner='generate' to use it as a generative model."
            )
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        request_ids = self._add_requests(prompts, params_list, priority)
        return self._run_engine(request_ids, use_tqdm)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[[int, int], None] = True,
        pooling_task: PoolingTask | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's hidden states (vLLM's ``LLM.encode``): one
        ``PoolingRequestOutput`` per prompt, in order, its ``outputs.data`` a float32 vector.

        Args:
            prompts: a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}``, or a list.
            pooling_params: one for all prompts or one per prompt (default: ``PoolingParams()``,
                the engine's ``PoolerConfig`` filling in what it leaves unset).
            use_tqdm: show a progress bar on a terminal; or a callable ``(done, total)``.
            pooling_task: the task, required as in vLLM (``"embed"``, the one served here).

        Raises:
            ValueError: the model runs with ``--runner generate``; no ``pooling_task``, or one the
                model does not serve; a prompt longer than ``max_model_len`` (a pooling prompt
                may fill it) or with a bad token id; bad pooling params; a mismatched number of
                params. Nothing is queued in that case.
        """
        self._check_open()
        runner_type = self.config.model_config.runner_type
        if runner_type != "pooling":
            raise ValueError(
                "LLM.encode() is only supported for pooling models. This one runs with --runner "
                f"{runner_type}: pass runner='pooling' to use it as a pooling model."
            )
        if pooling_task is None:
            raise ValueError(
                "pooling_task required for LLM.encode: use LLM.embed(...) or pooling_task='embed'."
            )
        supported = self.config.model_config.supported_tasks
        if pooling_task not in supported:
            raise ValueError(f"Unsupported task: {pooling_task!r}. Supported tasks: {supported}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params_list = (
            [pooling_params] * len(prompts)
            if isinstance(pooling_params, PoolingParams)
            else list(pooling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} pooling params")
        for params in params_list:
            if params.task is not None and params.task != pooling_task:
                raise ValueError(
                    f"task {params.task!r} of the pooling params differs from pooling_task {pooling_task!r}"
                )
        params_list = [msgspec.structs.replace(p, task=pooling_task) for p in params_list]
        request_ids = self._add_requests(prompts, params_list, None)
        return self._run_engine(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool | Callable[[int, int], None] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding vector for each prompt (vLLM's ``LLM.embed``): ``encode`` with the
        ``embed`` task, each output's ``outputs.embedding`` a list of floats (unit length
        unless ``use_activation=False``).

        Raises:
            ValueError: as ``encode``.
        """
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[[int, int], None] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then ``generate``.

        The template is ``chat_template`` when given, else the engine's ``chat_template=``
        (``--chat-template``), else the tokenizer's.

        ``messages`` is one conversation (``[{"role": "user", "content": "hi"}]``) or a
        list of them.

        Raises:
            ValueError: the tokenizer has no chat template (pass ``chat_template``).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(
                self.tokenizer, conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            for conv in conversations
        ]
        # The template already holds the special tokens; do not add a second BOS.
        token_prompts = [
            {"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in prompts
        ]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def shutdown(self) -> None:
        """Stop the engine and remove the run directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down")

    def _add_requests(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams] | list[PoolingParams],
        priority: Sequence[int] | None,
    ) -> list[str]:
        # Validate every prompt before queueing any, so a bad one loses nothing.
        prepared = []
        arrival = time.time()
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self.request_counter))
            prio = priority[i] if priority is not None else 0
            if isinstance(params, PoolingParams) or params.n == 1:
                req = self.input_processor.process_inputs(request_id, prompt, params, arrival, prio)
                prepared.append((request_id, [(req, None, 0)]))
                continue
            parent = ParentRequest(request_id, params)
            children = []
            for index in range(params.n):
                child_id, child_params = parent.get_child_info(index)
                req = self.input_processor.process_inputs(child_id, prompt, child_params, arrival, prio)
                children.append((req, parent, index))
            prepared.append((request_id, children))
        for (_, children), prompt in zip(prepared, prompts):
            text = _prompt_text(prompt)
            for req, parent, index in children:
                self.output_processor.add_request(req, text, parent, index)
                self.engine_core.add_request(req)
        return [request_id for request_id, _ in prepared]

    def _init_stats_log(self) -> None:
        """The periodic stats log line (vLLM: ``LLMEngine.do_log_stats_with_interval``), fed by
        the output processor; the llm_request span gets the model name."""
        from engine.metrics.loggers import LoggingStatLogger

        self.stat_logger = LoggingStatLogger(getattr(self.engine_core, "stats_table", None))
        self.output_processor.stats_sink = self.stat_logger.record
        self.output_processor.model_name = self.config.model_config.served_model_name
        self._next_stats_log = time.monotonic() + envs.GLASSBOX_LOG_STATS_INTERVAL

    def _log_stats_with_interval(self) -> None:
        now = time.monotonic()
        if now >= self._next_stats_log:
            self._next_stats_log = now + envs.GLASSBOX_LOG_STATS_INTERVAL
            self.stat_logger.log()

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool | Callable[[int, int], None]
    ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        total = len(request_ids)
        progress = _Progress(total, use_tqdm)
        idle_steps = 0
        try:
            while self.output_processor.has_unfinished_requests():
                outputs = self.engine_core.get_output()
                processed = self.output_processor.process_outputs(
                    outputs.outputs, outputs.timestamp, outputs.engine_index
                )
                self._log_stats_with_interval()
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        progress.advance(len(finished))
                idle_steps = (
                    0
                    if outputs.outputs or getattr(self.engine_core, "last_step_executed", True)
                    else idle_steps + 1
                )
                if idle_steps > MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"the engine made no progress for {MAX_IDLE_STEPS} steps with "
                        f"{self.output_processor.get_num_unfinished_requests()} requests unfinished"
                    )
        except BaseException:
            # Ctrl-C or an engine error: free what this call queued, then re-raise.
            pending = [rid for rid in request_ids if rid not in finished]
            child_ids = self.output_processor.abort_requests(pending)
            self.engine_core.abort_requests(child_ids)
            raise
        finally:
            progress.close()
        return [finished[rid] for rid in request_ids]


def _shutdown_engine(engine_core: EngineCoreClient, run_dir, recorder: Recorder | None = None) -> None:
    try:
        engine_core.shutdown()
    finally:
        _stop_telemetry(recorder)
        dead = getattr(engine_core, "dead", None)  # an MPClient's EngineDeadError, once its engine died
        run_dirs.close_run_dir(run_dir, failure="the engine died" if dead is not None else None,
                               root_cause=dead.root_cause if dead is not None else None,
                               telemetry_record=str(recorder.path) if recorder is not None else None)  # fmt: skip


def _set_fault_env(spec: str | None) -> Callable[[], None]:
    """Put ``spec`` in ``GLASSBOX_FAULT`` (when given); returns what puts the old value back."""
    if not spec:
        return lambda: None
    before = os.environ.get("GLASSBOX_FAULT")
    os.environ["GLASSBOX_FAULT"] = spec

    def restore() -> None:
        if before is None:
            os.environ.pop("GLASSBOX_FAULT", None)
        else:
            os.environ["GLASSBOX_FAULT"] = before

    return restore


def _stop_telemetry(recorder: Recorder | None) -> None:
    """Stop the recording (after the tree stopped: its last events are in the file) and this
    process's publisher (its socket is in the run directory)."""
    if recorder is not None:
        recorder.stop()
    stop_telemetry()


def _prompt_text(prompt: PromptType) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


class _Progress:
    """A Rich progress bar on a terminal (vLLM shows tqdm), or a user callback."""

    def __init__(self, total: int, use_tqdm: bool | Callable[[int, int], None]) -> None:
        import sys

        self.total = total
        self.callback = use_tqdm if callable(use_tqdm) else None
        self.bar = None
        if use_tqdm is True and total > 1 and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.task = self.bar.add_task("Processed prompts", total=total)
            self.bar.start()

    def advance(self, done: int) -> None:
        if self.callback is not None:
            self.callback(done, self.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

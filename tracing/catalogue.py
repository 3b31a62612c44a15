"""The span catalogue: every span name and attribute key Glassbox emits, defined once.

Code never spells a span name or attribute key as a string literal: it uses the constants
here (``catalogue.WORKER_LOAD_MODEL``, ``catalogue.ATTR_RANK``), and the stage helper
(``tracing.stage``) refuses names that are not in the catalogue. So this file is the
complete list of what a trace can contain (span events too: ``_event``), and ``docs/spans.md`` is generated from it::

    python -m tracing.catalogue > docs/spans.md

Each span has a *level*, which decides what it costs:

- ``lifecycle``: a start-up or shutdown stage. Rare, so it may do file I/O: entering or
  leaving one rewrites the process's status file (what ``glassbox ps`` and deadline
  messages read to name the stage a process is in).
- ``step``: one phase of one engine step. Runs many times a second, so it is kept cheap:
  a span and an in-memory stage record, never file I/O of its own.
- ``request``: one span per request (vLLM's ``llm_request``), recorded when the request ends.

Each span also names the kinds of process that enter it (``entered_by``: ``engine_core``,
``worker``, ...), so a fault aimed at a role that never enters its stage is refused before
anything starts (``TopologyPlan.check_fault_targets``).

Adding a name: call ``_span`` (or ``_attr``, ``_event``) below — a span with the kinds of
process that enter it — and a one-line doc, bind the result to a constant, and regenerate
``docs/spans.md`` (a test fails until you do).

Mirrors vLLM's ``vllm/tracing.py`` ``SpanAttributes`` for the ``gen_ai.*`` keys (OpenTelemetry
GenAI conventions, as vLLM spells them). vLLM has no catalogue of start-up spans; the
``glassbox.*`` names and the lifecycle spans are Glassbox's own.
"""

from __future__ import annotations

from dataclasses import dataclass

LIFECYCLE = "lifecycle"
STEP = "step"
REQUEST = "request"
LEVELS = (LIFECYCLE, STEP, REQUEST)

# Process kinds: the manifest's ``kind`` strings (``engine/distributed/topology.py``'s ``RoleKind``).
KIND_FRONTEND = "frontend"  # the offline LLM's process (the user's)
KIND_API_SERVER = "api_server"
KIND_ENGINE_CORE = "engine_core"
KIND_WORKER = "worker"
KIND_DP_COORDINATOR = "dp_coordinator"
KIND_HEADLESS = "headless"
PROCESS_KINDS = (
    KIND_FRONTEND,
    KIND_API_SERVER,
    KIND_ENGINE_CORE,
    KIND_WORKER,
    KIND_DP_COORDINATOR,
    KIND_HEADLESS,
)


@dataclass(frozen=True)
class AttrDef:
    """One attribute key: its OpenTelemetry value type and what it means."""

    key: str
    type: str  # "str" | "int" | "float" | "bool"
    doc: str

    @property
    def alias(self) -> str:
        """The keyword-argument spelling: ``glassbox.kv.num_blocks`` → ``kv_num_blocks``."""
        return self.key.removeprefix("glassbox.").replace(".", "_")


@dataclass(frozen=True)
class EventDef:
    """One span event name: what it marks and the attributes it carries."""

    name: str
    doc: str
    attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpanDef:
    """One span name: its level, which kinds of process enter it, what it covers, and the
    attributes it usually carries.

    ``entered_by``: the process kinds (``PROCESS_KINDS``) whose code enters (or records) the
    span. A kind's code can run in another kind's process: a worker's under the ``uni``
    executor runs in the engine core's, an engine core's in the ``LLM``'s process with
    ``GLASSBOX_ENABLE_MULTIPROCESSING=0``; ``TopologyPlan.roles_entering`` resolves that
    for one tree (and so which ``--inject-fault`` ``@ROLE`` can ever strike a stage).
    """

    name: str
    level: str
    entered_by: tuple[str, ...]
    doc: str
    attributes: tuple[str, ...] = ()


ATTRIBUTES: dict[str, AttrDef] = {}
SPANS: dict[str, SpanDef] = {}
EVENTS: dict[str, EventDef] = {}


def _attr(key: str, type_: str, doc: str) -> str:
    assert key not in ATTRIBUTES, f"attribute {key!r} defined twice"
    ATTRIBUTES[key] = AttrDef(key, type_, doc)
    return key


def _span(
    name: str, level: str, entered_by: tuple[str, ...], doc: str, attributes: tuple[str, ...] = ()
) -> str:
    assert name not in SPANS, f"span {name!r} defined twice"
    assert level in LEVELS, level
    assert entered_by and set(entered_by) <= set(PROCESS_KINDS), f"span {name!r}: entered_by {entered_by}"
    unknown = [a for a in attributes if a not in ATTRIBUTES]
    assert not unknown, f"span {name!r} lists unknown attributes {unknown}"
    SPANS[name] = SpanDef(name, level, entered_by, doc, attributes)
    return name


def _event(name: str, doc: str, attributes: tuple[str, ...] = ()) -> str:
    assert name not in EVENTS, f"event {name!r} defined twice"
    unknown = [a for a in attributes if a not in ATTRIBUTES]
    assert not unknown, f"event {name!r} lists unknown attributes {unknown}"
    EVENTS[name] = EventDef(name, doc, attributes)
    return name


# ---------------------------------------------------------------------------------------
# Attribute keys. Process identity (role, rank, pid) is also on every span's resource.
# ---------------------------------------------------------------------------------------

ATTR_ROLE = _attr("glassbox.role", "str", "Process role, e.g. EngineCore_DP0 or Worker_DP0_PP0_TP1.")
ATTR_RANK = _attr("glassbox.rank", "int", "Rank of the worker (or DP rank of the engine core) in its group.")
ATTR_PID = _attr("glassbox.pid", "int", "Operating-system process id.")
ATTR_THREAD_NAME = _attr(
    "thread.name",
    "str",
    "The thread a stage ran on (OpenTelemetry's key): MainThread, EngineCoreOutputThread ...",
)

ATTR_STEP_ID = _attr("glassbox.step.id", "int", "Engine step counter, from 0 at engine start.")
ATTR_STEP_DELAY_MS = _attr(
    "glassbox.step.delay_ms",
    "float",
    "Milliseconds of --step-delay-ms: the pause the busy loop makes after a step (on engine_core.step_delay), "
    "or the part of a request's wait in input_queue that was that pause (on engine_core.input_queue).",
)
ATTR_STEP_NUM_SCHEDULED_TOKENS = _attr(
    "glassbox.step.num_scheduled_tokens", "int", "Tokens scheduled in this step, over all requests."
)
ATTR_STEP_TOKEN_BUDGET = _attr(
    "glassbox.step.token_budget", "int", "Token budget of the step (max_num_batched_tokens)."
)
ATTR_STEP_NUM_NEW_REQS = _attr(
    "glassbox.step.num_new_reqs", "int", "Requests scheduled for the first time (or after preemption)."
)
ATTR_STEP_NUM_CACHED_REQS = _attr(
    "glassbox.step.num_cached_reqs", "int", "Requests scheduled again, whose state the worker keeps."
)
ATTR_STEP_NUM_PREEMPTED = _attr(
    "glassbox.step.num_preempted", "int", "Requests preempted (blocks freed, recomputed later) in this step."
)
ATTR_STEP_NUM_RUNNING = _attr("glassbox.step.num_running", "int", "Requests in RUNNING after the step.")
ATTR_STEP_NUM_WAITING = _attr("glassbox.step.num_waiting", "int", "Requests in WAITING after the step.")

ATTR_SO_KIND = _attr(
    "glassbox.structured_output.kind", "str", "The constraint: json, json_object, regex, choice or grammar."
)
ATTR_SO_SHORTEST_OUTPUT = _attr(
    "glassbox.structured_output.shortest_output",
    "int",
    "Tokens of the shortest whole output the grammar allows (its completion plan from the start; -1: "
    "none found); a request starts planning its completion twice that plus 8 tokens before max_tokens.",
)
ATTR_SO_NUM_REQS = _attr(
    "glassbox.structured_output.num_reqs",
    "int",
    "Structured-output requests that sample this step (bitmask rows).",
)

ATTR_DP_WAVE = _attr(
    "glassbox.dp.wave", "int", "Data-parallel request wave the engine is in (vLLM: current_wave)."
)

ATTR_KV_NUM_BLOCKS = _attr(
    "glassbox.kv.num_blocks", "int", "KV-cache blocks in the pool (null block included)."
)
ATTR_KV_USAGE = _attr("glassbox.kv.usage", "float", "Fraction of KV-cache blocks in use, 0.0 to 1.0.")
ATTR_KV_BLOCK_SIZE = _attr("glassbox.kv.block_size", "int", "Tokens per KV-cache block.")
# A block's bytes and the numbers they are made of:
# bytes_per_block = 2 (K and V) · block_size · num_layers · num_kv_heads · head_size · dtype_size.
ATTR_KV_BYTES_PER_BLOCK = _attr(
    "glassbox.kv.bytes_per_block",
    "int",
    "Bytes one block id costs on a worker: 2 (K and V) · block_size · num_layers · num_kv_heads · "
    "head_size · dtype_size.",
)
ATTR_KV_NUM_LAYERS = _attr(
    "glassbox.kv.num_layers", "int", "Decoder layers whose KV a worker holds (its pipeline stage's)."
)
ATTR_KV_NUM_KV_HEADS = _attr(
    "glassbox.kv.num_kv_heads",
    "int",
    "KV heads a worker holds: num_key_value_heads ÷ the tensor-parallel size (at least 1).",
)
ATTR_KV_HEAD_SIZE = _attr("glassbox.kv.head_size", "int", "Elements per KV head (the model's head_dim).")
ATTR_KV_DTYPE_SIZE = _attr(
    "glassbox.kv.dtype_size", "int", "Bytes per KV-cache element: 4 (float32), 2 (bfloat16, float16)."
)
ATTR_COMPILE_MODE = _attr(
    "glassbox.compile.mode", "str", 'How the model forward runs: "inductor" (torch.compile) or "eager".'
)
ATTR_COMPILE_NUM_GRAPHS = _attr(
    "glassbox.compile.num_graphs", "int", "Graphs torch.compile made during warm-up (1 serves every batch)."
)
ATTR_COMPILE_CACHE = _attr(
    "glassbox.compile.cache",
    "str",
    'Where the graphs came from: "hit" (loaded from the compile cache: a warm start), "miss" '
    '(compiled and written to it: a cold start), "mixed", or "off" (eager).',
)
ATTR_COMPILE_SECONDS = _attr(
    "glassbox.compile.seconds",
    "float",
    "Seconds torch.compile spent tracing and compiling (or loading its cache).",
)
ATTR_KV_AVAILABLE_BYTES = _attr(
    "glassbox.kv.available_bytes", "int", "Bytes a worker can give the KV cache, after profiling."
)

ATTR_MODEL_NAME = _attr("glassbox.model.name", "str", "Served model name (the model path unless renamed).")
ATTR_QUEUE_WAIT_MS = _attr(
    "glassbox.queue.wait_ms",
    "float",
    "Milliseconds an item waited in a queue (input_queue, output_queue, the broadcast queue).",
)
ATTR_MESSAGE_TYPE = _attr(
    "glassbox.message.type",
    "str",
    "Type of a message on a process boundary (ADD, ABORT, UTILITY, outputs ...).",
)
ATTR_NUM_CHUNKS = _attr(
    "glassbox.request.num_chunks", "int", "Steps a request's prefill was spread over (chunks)."
)
ATTR_REQUEST_IDS = _attr(
    "glassbox.request.ids", "str[]", "The request ids one message names (an ABORT may name several)."
)
ATTR_NUM_CHUNKS_SENT = _attr(
    "glassbox.response.num_chunks_sent",
    "int",
    "SSE chunks sent before the client went away (0: not streamed).",
)
ATTR_REQUEST_NUM_CACHED_TOKENS = _attr(
    "glassbox.request.num_cached_tokens",
    "int",
    "Prompt tokens served from the prefix cache (vLLM: RequestOutput.num_cached_tokens; "
    "usage.prompt_tokens_details.cached_tokens with --enable-prompt-tokens-details).",
)
ATTR_NUM_STEPS = _attr("glassbox.request.num_steps", "int", "Engine steps a request's decode phase took.")
ATTR_MODEL_DTYPE = _attr("glassbox.model.dtype", "str", "Resolved dtype of weights and activations.")
ATTR_DEVICE = _attr("glassbox.device", "str", "Resolved torch device, e.g. cpu or cuda:0.")

# vLLM's gen_ai.* keys (vllm/tracing.py SpanAttributes); latencies in seconds, as vLLM.
ATTR_GEN_AI_REQUEST_ID = _attr("gen_ai.request.id", "str", "The request id.")
ATTR_HTTP_ROUTE = _attr(
    "http.route",
    "str",
    "The HTTP route a request came in on, e.g. /v1/chat/completions or /v1/messages "
    "(OpenTelemetry's HTTP semantic conventions).",
)
ATTR_GEN_AI_USAGE_PROMPT_TOKENS = _attr("gen_ai.usage.prompt_tokens", "int", "Tokens in the prompt.")
ATTR_GEN_AI_USAGE_COMPLETION_TOKENS = _attr(
    "gen_ai.usage.completion_tokens", "int", "Tokens generated for the request."
)
ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = _attr(
    "gen_ai.latency.time_to_first_token", "float", "Seconds from arrival to the first output token."
)
ATTR_GEN_AI_LATENCY_E2E = _attr(
    "gen_ai.latency.e2e", "float", "Seconds from arrival to the last output token."
)
ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE = _attr(
    "gen_ai.latency.time_in_queue", "float", "Seconds spent WAITING before first being scheduled."
)
ATTR_GEN_AI_REQUEST_MAX_TOKENS = _attr(
    "gen_ai.request.max_tokens", "int", "max_tokens of the sampling params."
)
ATTR_GEN_AI_REQUEST_TEMPERATURE = _attr(
    "gen_ai.request.temperature", "float", "temperature of the sampling params."
)
ATTR_GEN_AI_REQUEST_TOP_P = _attr("gen_ai.request.top_p", "float", "top_p of the sampling params.")
ATTR_GEN_AI_REQUEST_N = _attr("gen_ai.request.n", "int", "Number of sequences asked for (n).")
ATTR_GEN_AI_RESPONSE_MODEL = _attr("gen_ai.response.model", "str", "Model name reported in the response.")
ATTR_GEN_AI_REQUEST_MODEL = _attr("gen_ai.request.model", "str", "Model name the request asked for.")
ATTR_GEN_AI_USAGE_INPUT_TOKENS = _attr(
    "gen_ai.usage.input_tokens",
    "int",
    "Tokens in the prompt (OpenTelemetry GenAI spelling; = usage.prompt_tokens).",
)
ATTR_GEN_AI_USAGE_OUTPUT_TOKENS = _attr(
    "gen_ai.usage.output_tokens",
    "int",
    "Tokens generated (OpenTelemetry GenAI spelling; = usage.completion_tokens).",
)
ATTR_GEN_AI_RESPONSE_FINISH_REASONS = _attr(
    "gen_ai.response.finish_reasons", "str[]", "Why the request finished: stop, length or abort (one entry)."
)
ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = _attr(
    "gen_ai.latency.time_in_model_prefill", "float", "Seconds from first scheduled to the first token."
)
ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = _attr(
    "gen_ai.latency.time_in_model_decode", "float", "Seconds from the first token to the last."
)
ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = _attr(
    "gen_ai.latency.time_in_model_inference", "float", "Seconds from first scheduled to the last token."
)

_WORKER = (ATTR_RANK,)
_STEP_BATCH = (
    ATTR_STEP_ID,
    ATTR_STEP_NUM_SCHEDULED_TOKENS,
    ATTR_STEP_TOKEN_BUDGET,
    ATTR_STEP_NUM_NEW_REQS,
    ATTR_STEP_NUM_CACHED_REQS,
    ATTR_STEP_NUM_PREEMPTED,
)

# ---------------------------------------------------------------------------------------
# Lifecycle spans, in start-up order.
# ---------------------------------------------------------------------------------------

CLI_VALIDATE_CONFIG = _span(
    "cli.validate_config",
    LIFECYCLE,
    (KIND_FRONTEND, KIND_API_SERVER),
    "Build and validate the whole EngineConfig before anything is spawned.",
)
LLM_INIT = _span(
    "llm.init",
    LIFECYCLE,
    (KIND_FRONTEND,),
    "The offline LLM constructor: config, tokenizer, engine (vLLM: LLM.__init__).",
    (ATTR_MODEL_NAME,),
)
PROCESS_SPAWN = _span(
    "process.spawn",
    LIFECYCLE,
    (KIND_FRONTEND, KIND_API_SERVER, KIND_ENGINE_CORE, KIND_HEADLESS),
    "Start one child process (engine core or worker): a fresh interpreter titled glassbox::<role>.",
    (ATTR_ROLE, ATTR_PID),
)
ENGINE_CORE_HANDSHAKE = _span(
    "engine_core.handshake",
    LIFECYCLE,
    (KIND_FRONTEND, KIND_API_SERVER),
    "Frontend side of start-up: spawn the engine core, wait for HELLO then READY (one deadline).",
    (ATTR_KV_NUM_BLOCKS,),
)
API_SERVER_START_OTHERS = _span(
    "api_server.start_api_servers",
    LIFECYCLE,
    (KIND_API_SERVER,),
    "APIServer_0 with --api-server-count A > 1: spawn APIServer_1..A-1 on the shared listening "
    "socket and wait until each is serving (one deadline).",
    (ATTR_ROLE,),
)
API_SERVER_ATTACH = _span(
    "api_server.attach",
    LIFECYCLE,
    (KIND_API_SERVER,),
    "APIServer_<i> (i > 0): attach to the engine cores APIServer_0 launched (their CONNECTED on its "
    "own input socket), then build its app.",
    (ATTR_ROLE,),
)
ENGINE_CORE_JOIN_HEAD = _span(
    "engine_core.join_head",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "A headless node's engine core (multi-node DP): HELLO on the head's join socket, then wait for "
    "the addresses of its engine sockets (GLASSBOX_DP_JOIN_TIMEOUT_S).",
    (),
)
ENGINE_CORE_INIT = _span(
    "engine_core.init",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "EngineCore.__init__: executor, KV-cache sizing, scheduler.",
    (ATTR_RANK,),
)
EXECUTOR_INIT = _span(
    "executor.init",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "Executor start-up: build the workers, init_device and load_model on each.",
)
WORKER_WRAPPER_INIT = _span(
    "worker.wrapper_init",
    LIFECYCLE,
    (KIND_WORKER,),
    "WorkerWrapperBase.__init__: keep config and rpc rank; nothing heavy.",
    _WORKER,
)
WORKER_INIT_WORKER = _span(
    "worker.init_worker", LIFECYCLE, (KIND_WORKER,), "Resolve the worker class and build the Worker.", _WORKER
)
WORKER_INIT_DEVICE = _span(
    "worker.init_device",
    LIFECYCLE,
    (KIND_WORKER,),
    "Pick device and dtype, seed the RNGs, set up distributed groups.",
    (ATTR_RANK, ATTR_DEVICE, ATTR_MODEL_DTYPE),
)
WORKER_LOAD_MODEL = _span(
    "worker.load_model",
    LIFECYCLE,
    (KIND_WORKER,),
    "Build the model and load (this rank's shard of) the weights.",
    (ATTR_RANK, ATTR_MODEL_NAME),
)
WORKER_DETERMINE_AVAILABLE_MEMORY = _span(
    "worker.determine_available_memory",
    LIFECYCLE,
    (KIND_WORKER,),
    "Profile run at the largest batch; report the bytes left for the KV cache.",
    (ATTR_RANK, ATTR_KV_AVAILABLE_BYTES),
)
ENGINE_CORE_INITIALIZE_KV_CACHE = _span(
    "engine_core.initialize_kv_cache",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "Size the KV cache: num_blocks = available bytes / bytes per block, then tell the workers.",
    (
        ATTR_KV_AVAILABLE_BYTES,
        ATTR_KV_NUM_BLOCKS,
        ATTR_KV_BLOCK_SIZE,
        ATTR_KV_BYTES_PER_BLOCK,
        ATTR_KV_NUM_LAYERS,
        ATTR_KV_NUM_KV_HEADS,
        ATTR_KV_HEAD_SIZE,
        ATTR_KV_DTYPE_SIZE,
    ),
)
WORKER_INITIALIZE_KV_CACHE = _span(
    "worker.initialize_kv_cache",
    LIFECYCLE,
    (KIND_WORKER,),
    "Allocate the KV-cache tensors and bind them to the layers.",
    (ATTR_RANK, ATTR_KV_NUM_BLOCKS),
)
WORKER_COMPILE_OR_WARM_UP_MODEL = _span(
    "worker.compile_or_warm_up_model",
    LIFECYCLE,
    (KIND_WORKER,),
    "Compile the model forward (torch.compile; from the cache when warm) and run warm-up steps, "
    "so the first request pays no one-time cost.",
    (ATTR_RANK, ATTR_COMPILE_MODE, ATTR_COMPILE_NUM_GRAPHS, ATTR_COMPILE_CACHE, ATTR_COMPILE_SECONDS),
)
DP_COORDINATOR_INIT = _span(
    "dp_coordinator.init",
    LIFECYCLE,
    (KIND_DP_COORDINATOR,),
    "DPCoordinator start-up (-dp N > 1): bind its sockets (engines' loads in, the load table out to "
    "the API servers, request waves out to the engines) before its loop starts.",
)
DP_COORDINATOR_SHUTDOWN = _span(
    "dp_coordinator.shutdown",
    LIFECYCLE,
    (KIND_DP_COORDINATOR,),
    "DPCoordinator shut-down: close its sockets.",
)
ENGINE_CORE_SHUTDOWN = _span(
    "engine_core.shutdown",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "Stop the busy loop, shut the executor and workers down.",
)

# ---------------------------------------------------------------------------------------
# Step spans: one engine step = schedule → execute_model → update_from_output.
# ---------------------------------------------------------------------------------------

ENGINE_CORE_STEP = _span(
    "engine_core.step",
    STEP,
    (KIND_ENGINE_CORE,),
    "One engine step (parent of the three below).",
    (*_STEP_BATCH, ATTR_STEP_NUM_RUNNING, ATTR_STEP_NUM_WAITING, ATTR_KV_USAGE),
)
SCHEDULER_SCHEDULE = _span(
    "scheduler.schedule",
    STEP,
    (KIND_ENGINE_CORE,),
    "Scheduler.schedule(): pick requests and tokens under the token budget.",
    _STEP_BATCH,
)
EXECUTOR_EXECUTE_MODEL = _span(
    "executor.execute_model",
    STEP,
    (KIND_ENGINE_CORE,),
    "Run the forward pass and sampling on the workers.",
    (ATTR_STEP_ID,),
)
ENGINE_CORE_INIT_DP_GROUP = _span(
    "engine_core.init_dp_group",
    LIFECYCLE,
    (KIND_ENGINE_CORE,),
    "Expert parallelism across DP engines: the engine cores meet in their own gloo group (vLLM: "
    "stateless_init_dp_group), where they decide together when a request wave ends.",
    (ATTR_RANK,),
)
ENGINE_CORE_DUMMY_STEP = _span(
    "engine_core.dummy_step",
    STEP,
    (KIND_ENGINE_CORE,),
    "Data parallelism: a dummy batch on an engine with no requests while its wave runs (vLLM: "
    "execute_dummy_batch), so every engine steps while any has work.",
    (ATTR_DP_WAVE,),
)
WORKER_EXECUTE_DUMMY_BATCH = _span(
    "worker.execute_dummy_batch",
    STEP,
    (KIND_WORKER,),
    "One forward of a one-token dummy request into the null block, and a sampler run.",
    _WORKER,
)
SCHEDULER_UPDATE_FROM_OUTPUT = _span(
    "scheduler.update_from_output",
    STEP,
    (KIND_ENGINE_CORE,),
    "Append sampled tokens, check stop conditions, free finished requests.",
    (ATTR_STEP_ID, ATTR_STEP_NUM_RUNNING, ATTR_STEP_NUM_WAITING, ATTR_KV_USAGE),
)

# Structured outputs (engine/core/structured_output/): the grammar compile, in the manager's
# thread pool, and the step's bitmask, between schedule and execute_model.
STRUCTURED_OUTPUT_COMPILE_GRAMMAR = _span(
    "structured_output.compile_grammar",
    STEP,
    (KIND_ENGINE_CORE,),
    "Compile one request's grammar (JSON schema, regex, choice or grammar) with llguidance, in the "
    "StructuredOutputManager's thread pool, while the request waits as WAITING_FOR_FSM; in the request's "
    "trace (a copy of the backend's compiled grammar when the constraint was seen before).",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_SO_KIND, ATTR_SO_SHORTEST_OUTPUT, ATTR_THREAD_NAME),
)
STRUCTURED_OUTPUT_GRAMMAR_BITMASK = _span(
    "structured_output.grammar_bitmask",
    STEP,
    (KIND_ENGINE_CORE,),
    "StructuredOutputManager.grammar_bitmask(): one row of allowed tokens per structured request "
    "that samples this step; it rides on the SchedulerOutput to the workers.",
    (ATTR_STEP_ID, ATTR_SO_NUM_REQS),
)

# Step spans in the other threads and processes (vLLM has none of these).
ENGINE_CORE_OUTPUT_SEND = _span(
    "engine_core.output_send",
    STEP,
    (KIND_ENGINE_CORE,),
    "The output thread: one step's outputs for one client taken off output_queue (wait as an "
    "attribute), encoded and pushed to that client's socket. Child of the step that made them.",
    (ATTR_QUEUE_WAIT_MS, ATTR_THREAD_NAME),
)
ENGINE_CORE_STEP_DELAY = _span(
    "engine_core.step_delay",
    STEP,
    (KIND_ENGINE_CORE,),
    "--step-delay-ms: the busy loop sleeps after a step (slow motion for a class), after the step's span "
    "and outside its time (engine-top shows it apart: its delay column). A request that arrives meanwhile "
    "waits in input_queue: its engine_core.input_queue span says how much of its wait this pause was.",
    (ATTR_STEP_ID, ATTR_STEP_DELAY_MS),
)
EXECUTOR_BROADCAST = _span(
    "executor.broadcast",
    STEP,
    (KIND_ENGINE_CORE,),
    "The engine core writes one RPC (e.g. execute_model) into the shared-memory broadcast queue.",
)
WORKER_EXECUTE_MODEL = _span(
    "worker.execute_model",
    STEP,
    (KIND_WORKER,),
    "A worker runs one step (--collect-detailed-traces worker|all): the RPC waited in the broadcast "
    "queue (attribute), then forward and sampling; child of the engine core's executor.execute_model.",
    (ATTR_RANK, ATTR_QUEUE_WAIT_MS),
)
MODEL_RUNNER_FORWARD = _span(
    "model_runner.forward",
    STEP,
    (KIND_WORKER,),
    "The model's forward pass for one step (--collect-detailed-traces model|worker|all).",
    (ATTR_STEP_NUM_SCHEDULED_TOKENS,),
)
MODEL_RUNNER_SAMPLE = _span(
    "model_runner.sample",
    STEP,
    (KIND_WORKER,),
    "Logits to next tokens for one step: the sampler (--collect-detailed-traces model|worker|all).",
)
MODEL_RUNNER_POOL = _span(
    "model_runner.pool",
    STEP,
    (KIND_WORKER,),
    "Hidden states to one vector per finished prompt, a pooling model's step: the pooler, in place "
    "of the sampler (--runner pooling; --collect-detailed-traces model|worker|all).",
)
ATTR_MOE_LAYER = _attr(
    "glassbox.moe.layer", "int", "The MoE layer's decoder-layer index on this pipeline stage."
)
ATTR_MOE_NUM_TOKENS = _attr("glassbox.moe.num_tokens", "int", "Tokens this rank routes through the layer.")
ATTR_MOE_ROWS_SENT = _attr(
    "glassbox.moe.rows_sent",
    "int",
    "Expert parallelism: (token, expert) rows this rank sends to the experts' ranks.",
)
ATTR_MOE_ROWS_RECEIVED = _attr(
    "glassbox.moe.rows_received", "int", "Expert parallelism: rows this rank's experts get from every rank."
)
ATTR_MOE_WAIT_MS = _attr(
    "glassbox.moe.collective_ms",
    "float",
    "Time inside the phase's all-to-alls, ms: mostly waiting for the slowest rank to reach them.",
)
MOE_ROUTER = _span(
    "moe.router",
    STEP,
    (KIND_WORKER,),
    "A mixture of experts' router: each token's top-k experts and their weights (fused_topk), one "
    "layer (--collect-detailed-traces model|worker|all).",
    (ATTR_MOE_LAYER, ATTR_MOE_NUM_TOKENS),
)
MOE_DISPATCH = _span(
    "moe.dispatch",
    STEP,
    (KIND_WORKER,),
    "Expert parallelism: each (token, expert) row sent to the rank holding the expert, two all-to-alls "
    "(counts, rows) over every worker of every DP engine, one layer (--collect-detailed-traces "
    "model|worker|all).",
    (ATTR_MOE_LAYER, ATTR_MOE_ROWS_SENT, ATTR_MOE_ROWS_RECEIVED, ATTR_MOE_WAIT_MS),
)
MOE_EXPERTS = _span(
    "moe.experts",
    STEP,
    (KIND_WORKER,),
    "This rank's experts on the rows routed to them, one layer (--collect-detailed-traces model|worker|all).",
    (ATTR_MOE_LAYER,),
)
MOE_COMBINE = _span(
    "moe.combine",
    STEP,
    (KIND_WORKER,),
    "Expert parallelism: each expert output sent back to its token's rank (one all-to-all), one layer "
    "(--collect-detailed-traces model|worker|all).",
    (ATTR_MOE_LAYER, ATTR_MOE_WAIT_MS),
)

# ---------------------------------------------------------------------------------------
# Request spans.
# ---------------------------------------------------------------------------------------

LLM_REQUEST = _span(
    "llm_request",
    REQUEST,
    (KIND_FRONTEND, KIND_API_SERVER),
    "One finished request, from arrival to its last token (vLLM's span name).",
    (
        ATTR_GEN_AI_REQUEST_ID,
        ATTR_GEN_AI_REQUEST_MODEL,
        ATTR_GEN_AI_RESPONSE_MODEL,
        ATTR_GEN_AI_USAGE_PROMPT_TOKENS,
        ATTR_GEN_AI_USAGE_COMPLETION_TOKENS,
        ATTR_GEN_AI_USAGE_INPUT_TOKENS,
        ATTR_GEN_AI_USAGE_OUTPUT_TOKENS,
        ATTR_REQUEST_NUM_CACHED_TOKENS,
        ATTR_GEN_AI_RESPONSE_FINISH_REASONS,
        ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE,
        ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
        ATTR_GEN_AI_LATENCY_E2E,
        ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
        ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
        ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE,
        ATTR_GEN_AI_REQUEST_MAX_TOKENS,
        ATTR_GEN_AI_REQUEST_TEMPERATURE,
        ATTR_GEN_AI_REQUEST_TOP_P,
        ATTR_GEN_AI_REQUEST_N,
    ),
)

DP_COORDINATOR_WAVE = _span(
    "dp_coordinator.wave",
    REQUEST,
    (KIND_DP_COORDINATOR,),
    "A data-parallel request wave, from the request that started it (its trace) to the moment "
    "every engine was back at zero waiting and running.",
    (ATTR_DP_WAVE,),
)
API_SERVER_REQUEST = _span(
    "api_server.request",
    REQUEST,
    (KIND_API_SERVER,),
    "One HTTP request in the API server, from its arrival to its last streamed byte: the root of a "
    "request's trace (or a child of the caller's traceparent). Everything below joins it.",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_HTTP_ROUTE),
)
API_SERVER_PROCESS_INPUTS = _span(
    "api_server.process_inputs",
    REQUEST,
    (KIND_API_SERVER,),
    "Tokenize the prompt (chat template first for chat) and validate it against max_model_len.",
    (ATTR_GEN_AI_REQUEST_ID,),
)
ENGINE_CORE_INPUT = _span(
    "engine_core.input",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "The engine core's input thread receives and decodes one request from its client's socket.",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_MESSAGE_TYPE, ATTR_THREAD_NAME),
)
ENGINE_CORE_INPUT_QUEUE = _span(
    "engine_core.input_queue",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "The request waited in input_queue until the busy loop took it (with --step-delay-ms, mostly the "
    "pause after a step: glassbox.step.delay_ms says how much).",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_QUEUE_WAIT_MS, ATTR_STEP_DELAY_MS),
)
SCHEDULER_WAITING = _span(
    "scheduler.waiting",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "The request waited in the scheduler's WAITING queue until first scheduled (vLLM: time in queue).",
    (ATTR_GEN_AI_REQUEST_ID,),
)
REQUEST_PREFILL = _span(
    "request.prefill",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "From first scheduled to the first token: the prompt's prefill, in one or more chunks (links: "
    "the engine_core.step spans that computed it).",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_NUM_CHUNKS),
)
REQUEST_DECODE = _span(
    "request.decode",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "From the first token to the last: the decode phase (links: its first and last engine_core.step); "
    "an abort ends it then.",
    (ATTR_GEN_AI_REQUEST_ID, ATTR_NUM_STEPS, ATTR_GEN_AI_RESPONSE_FINISH_REASONS),
)
ENGINE_CORE_ABORT = _span(
    "engine_core.abort",
    REQUEST,
    (KIND_ENGINE_CORE,),
    "One ABORT message sent in a request's trace (its client went away, or the shutdown timeout ran "
    "out), from the input thread receiving it to the busy loop having finished its requests as aborted "
    "and freed their KV blocks (the wait in input_queue as an attribute). A request aborted before its first token ends "
    "its scheduler.waiting or request.prefill then, with finish reason abort.",
    (ATTR_REQUEST_IDS, ATTR_QUEUE_WAIT_MS),
)

# ---------------------------------------------------------------------------------------
# Span events: a moment inside a span (OpenTelemetry's span events).
# ---------------------------------------------------------------------------------------

EVENT_CLIENT_DISCONNECTED = _event(
    "glassbox.client_disconnected",
    "On api_server.request: the HTTP client went away before the response was complete; the request "
    "was aborted in the engine (llm_request ends with finish reason abort). Not an error of the server: "
    "the span's status stays unset.",
    (ATTR_NUM_CHUNKS_SENT,),
)
EVENT_STOPPED_BY_SHUTDOWN = _event(
    "stopped by shutdown", "On a stage span still open when its process shut down (the stage never finished)."
)

# Keyword spellings accepted by ``stage(...)``: ``rank=0`` means ``glassbox.rank``.
ALIASES: dict[str, str] = {a.alias: a.key for a in ATTRIBUTES.values()}


def event_def(name: str) -> EventDef:
    """The definition of span event ``name``.

    Raises:
        KeyError: ``name`` is not in the catalogue.
    """
    try:
        return EVENTS[name]
    except KeyError:
        raise KeyError(f"event {name!r} is not in the catalogue; define it in tracing/catalogue.py") from None


def span_def(name: str) -> SpanDef:
    """The definition of span ``name``.

    Raises:
        KeyError: ``name`` is not in the catalogue (the message says where to add it).
    """
    try:
        return SPANS[name]
    except KeyError:
        raise KeyError(f"span {name!r} is not in the catalogue; define it in tracing/catalogue.py") from None


def attr_key(name: str) -> str:
    """The catalogue key for ``name``: a full key (``glassbox.rank``) or its alias (``rank``).

    Raises:
        KeyError: neither a key nor an alias in the catalogue.
    """
    if name in ATTRIBUTES:
        return name
    try:
        return ALIASES[name]
    except KeyError:
        raise KeyError(
            f"attribute {name!r} is not in the catalogue; define it in tracing/catalogue.py"
        ) from None


def render_markdown() -> str:
    """The catalogue as Markdown (the text of ``docs/spans.md``)."""
    lines = [
        "# Span catalogue",
        "",
        "<!-- Generated by `python -m tracing.catalogue > docs/spans.md`; do not edit by hand. -->",
        "",
        "Every span and attribute Glassbox emits is defined once, in `tracing/catalogue.py`.",
        "Levels: **lifecycle** stages (start-up and shutdown; each also rewrites the process's",
        "status file), **step** phases (every engine step; kept cheap, no file I/O) and",
        "**request** spans (one per finished request). Every span's resource carries",
        "`service.name=glassbox`, `glassbox.role`, `glassbox.pid` and, where set, `glassbox.rank`.",
        "*Entered by* names the kinds of process whose code enters the span (`frontend` is an",
        "offline `LLM`'s process, which also runs the engine core's stages with",
        "`GLASSBOX_ENABLE_MULTIPROCESSING=0`; under the `uni` executor the engine core runs the",
        "worker's); `--inject-fault` refuses a `@ROLE` that never enters its stage.",
        "",
    ]
    titles = {LIFECYCLE: "Lifecycle spans", STEP: "Step spans", REQUEST: "Request spans"}
    for level in LEVELS:
        lines += [
            f"## {titles[level]}",
            "",
            "| span | entered by | what it covers | attributes |",
            "|---|---|---|---|",
        ]
        for s in SPANS.values():
            if s.level == level:
                attrs = ", ".join(f"`{a}`" for a in s.attributes) or "—"
                lines.append(f"| `{s.name}` | {', '.join(s.entered_by)} | {s.doc} | {attrs} |")
        lines.append("")
    lines += ["## Span events", "", "| event | what it marks | attributes |", "|---|---|---|"]
    for e in EVENTS.values():
        attrs = ", ".join(f"`{a}`" for a in e.attributes) or "—"
        lines.append(f"| `{e.name}` | {e.doc} | {attrs} |")
    lines.append("")
    lines += [
        "## Attributes",
        "",
        "`stage(...)` accepts a key either whole (`**{catalogue.ATTR_RANK: 0}`) or by its",
        "keyword alias (`rank=0`).",
        "",
        "| key | type | keyword alias | meaning |",
        "|---|---|---|---|",
    ]
    for a in ATTRIBUTES.values():
        lines.append(f"| `{a.key}` | {a.type} | `{a.alias}` | {a.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")

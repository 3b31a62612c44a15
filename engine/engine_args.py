"""Engine flags: one dataclass field per CLI flag, and the ``EngineConfig`` built from them.

Mirrors vLLM's ``vllm/engine/arg_utils.py`` (``EngineArgs``, ``add_cli_args``,
``from_cli_args``, ``create_engine_config``). Flag names are ``vllm serve``'s. Building the
config validates everything (``ConfigError`` names the flag) and imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import (
    BLOCK_SIZES,
    CPU_BF16_MODES,
    CPU_BRGEMM_LINEAR_MODES,
    CPU_F32_LINEAR_MODES,
    CPU_LINEAR_KERNEL_MODES,
    DEFAULT_DP_RPC_PORT,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MODEL,
    DEVICES,
    DTYPES,
    EXECUTOR_BACKENDS,
    RAY_INSTALL_HINT,
    SCHEDULING_POLICIES,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from engine.kv_cache.kv_cache_planning import check_fixed_kv_budget
from engine.logger import init_logger

logger = init_logger(__name__)

# vLLM's CPU defaults for the offline LLM class (FACTS §2.3), scaled by world size 1.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"llm": 4096, "serve": 2048}
DEFAULT_MAX_NUM_SEQS = {"llm": 256, "serve": 128}


@dataclass(frozen=True)
class VllmFlag:
    """A ``vllm serve`` flag Glassbox knows but does not implement.

    ``takes_value``: the flag is followed by a value. ``allowed``: values that are accepted
    because they ask for nothing Glassbox lacks (e.g. ``--runner generate``).
    ``serving``: a flag of ``vllm serve``'s HTTP frontend (not of the engine).
    """

    names: tuple[str, ...]
    takes_value: bool
    reason: str
    allowed: tuple[str, ...] = ()
    serving: bool = False


# Flags a vLLM user may pass by habit that change nothing here: accepted, with a note.
# (--trust-remote-code is accepted too, as an EngineArgs field, so LLM(trust_remote_code=True) works.)
IGNORED_VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--download-dir",), True, "models are local directories; nothing is ever downloaded"),
    VllmFlag(
        ("--disable-log-stats",),
        False,
        "the periodic stats line is tuned by GLASSBOX_LOG_STATS_INTERVAL; GET /metrics is always on",
    ),
    VllmFlag(
        ("--disable-custom-all-reduce",),
        False,
        "there is no custom all-reduce kernel: tensor parallelism's all-reduce is always "
        "torch.distributed's (gloo on a CPU, NCCL on CUDA)",
    ),
)

# vLLM flags Glassbox refuses: one line naming the flag, exit status 2.
REFUSED_VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(
        ("--quantization", "-q"),
        True,
        "quantized checkpoints are left out; use a float16/bfloat16/float32 one",
    ),
    VllmFlag(
        ("--swap-space",),
        True,
        "preempted requests are recomputed, never swapped to CPU memory (as in vLLM V1)",
    ),
    VllmFlag(("--cpu-offload-gb",), True, "weights are never offloaded"),
    VllmFlag(("--speculative-config",), True, "speculative decoding is left out"),
    VllmFlag(("--enable-lora",), False, "LoRA adapters are left out"),
    VllmFlag(("--max-loras",), True, "LoRA adapters are left out"),
    VllmFlag(("--max-lora-rank",), True, "LoRA adapters are left out"),
    VllmFlag(("--lora-modules",), True, "LoRA adapters are left out", serving=True),
    VllmFlag(("--kv-transfer-config",), True, "disaggregated prefill (KV transfer) is left out"),
    VllmFlag(("--enable-sleep-mode",), False, "sleep mode is left out"),
    VllmFlag(
        ("--compilation-config", "-O"),
        True,
        "the model is compiled (torch.compile, Inductor, Glassbox's settings) unless --enforce-eager or "
        "GLASSBOX_TORCH_COMPILE=0; there are no levels to choose",
    ),
    VllmFlag(("--hf-overrides",), True, "config.json is read as it is"),
    VllmFlag(("--rope-scaling",), True, "config.json is read as it is"),
    VllmFlag(("--revision",), True, "models are local directories: there is no revision to pick"),
    VllmFlag(("--tokenizer-revision",), True, "models are local directories: there is no revision to pick"),
    VllmFlag(("--code-revision",), True, "no remote code is ever run"),
    VllmFlag(
        ("--task",),
        True,
        "vLLM 0.32 has no --task: use --runner generate, or --runner pooling for embeddings",
        allowed=("auto", "generate"),
    ),
    VllmFlag(("--limit-mm-per-prompt",), True, "multimodal inputs are left out"),
    VllmFlag(("--enable-prompt-embeds",), False, "prompt embeddings are left out"),
    VllmFlag(
        ("--guided-decoding-backend",),
        True,
        "vLLM removed it in 0.12 (vLLM 0.32 does not know it): use --structured-outputs-config "
        '\'{"backend": "guidance"}\'',
    ),
    VllmFlag(("--reasoning-parser",), True, "reasoning parsers are left out", serving=True),
    VllmFlag(
        ("--enable-auto-tool-choice",),
        False,
        'tool parsers are left out: tool_choice "required" or a named function work without one',
        serving=True,
    ),
    VllmFlag(
        ("--tool-call-parser",),
        True,
        'tool parsers are left out: tool_choice "required" or a named function work without one',
        serving=True,
    ),
    VllmFlag(("--ssl-keyfile",), True, "HTTPS is left out; put a TLS proxy in front", serving=True),
    VllmFlag(("--ssl-certfile",), True, "HTTPS is left out; put a TLS proxy in front", serving=True),
    VllmFlag(("--uds",), True, "the server listens on TCP only", serving=True),
)


class _IgnoredFlagAction(argparse.Action):
    """Consume an accepted-but-ignored vLLM flag (and its value) and log why it changes nothing."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True if values is None or values == [] else values)
        logger.info("%s is accepted for vLLM compatibility and ignored: %s", option_string, self.reason)


class _RefusedFlagAction(argparse.Action):
    """A vLLM flag Glassbox does not implement: one line naming it, exit status 2."""

    def __init__(self, option_strings, dest, flag: VllmFlag | None = None, **kwargs) -> None:
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        assert self.flag is not None
        if self.flag.allowed and values in self.flag.allowed:
            return  # asks for nothing Glassbox lacks
        given = option_string if values in (None, []) else f"{option_string} {values}"
        allowed = f"; only {', '.join(self.flag.allowed)} is accepted" if self.flag.allowed else ""
        parser.error(f"{given}: Glassbox does not support this vLLM flag ({self.flag.reason}{allowed})")


def add_vllm_compat_flags(parser: argparse.ArgumentParser, serving: bool) -> None:
    """Register the accepted-but-ignored and the refused vLLM flags on ``parser``.

    The refused ones are hidden from ``--help`` (docs/configuration.md lists them); passing
    one exits with status 2 and a line that names it, instead of argparse's "unrecognized
    arguments". ``serving``: also the flags of ``vllm serve``'s HTTP frontend.
    """
    g = parser.add_argument_group("Accepted for vLLM compatibility (no effect)")
    for flag in IGNORED_VLLM_FLAGS:
        if flag.serving and not serving:
            continue
        g.add_argument(
            *flag.names,
            action=_IgnoredFlagAction,
            reason=flag.reason,
            nargs=None if flag.takes_value else 0,
            default=None,
            help=f"Ignored: {flag.reason}.",
        )
    for flag in REFUSED_VLLM_FLAGS:
        if flag.serving and not serving:
            continue
        parser.add_argument(
            *flag.names,
            action=_RefusedFlagAction,
            flag=flag,
            nargs="?" if flag.takes_value else 0,
            default=None,
            dest=f"_refused_{flag.names[0].lstrip('-').replace('-', '_')}",
            help=argparse.SUPPRESS,
        )


def drop_vllm_compat_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)``'s twin of ``add_vllm_compat_flags``: the same vLLM flags as keywords.

    Returns ``kwargs`` without the accepted-but-ignored ones (each logs a note) and without
    harmless values of refused ones (``task="generate"``).

    Raises:
        ConfigError: a refused flag (``quantization="awq"``); the message names the flag.
    """
    from engine.config import ConfigError

    kept = dict(kwargs)
    for flag in IGNORED_VLLM_FLAGS + REFUSED_VLLM_FLAGS:
        key = flag.names[0].lstrip("-").replace("-", "_")
        if key not in kept:
            continue
        value = kept.pop(key)
        if flag in IGNORED_VLLM_FLAGS:
            logger.info("%s is accepted for vLLM compatibility and ignored: %s", key, flag.reason)
        elif not (flag.allowed and str(value) in flag.allowed):
            raise ConfigError(
                flag.names[0], value, f"Glassbox does not support this vLLM flag: {flag.reason}"
            )
    return kept


def _json_object(example: str) -> Callable[[str], dict[str, Any]]:
    """The argparse ``type`` of a JSON-object flag; its errors show ``example``, one of this
    flag's own values."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON ({e}); give an object, e.g. '{example}'") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{example}'")
        return value

    return parse


@dataclass
class EngineArgs:
    """Every engine flag with its default. ``None`` means "work it out" (see each help)."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    chat_template: str | None = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | PoolerConfig | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_DP_RPC_PORT
    headless: bool = False
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False
    attention_backend: str | None = None
    cpu_bf16_linear: str = "auto"
    cpu_bf16_attention: str = "auto"
    cpu_f32_linear: str = "auto"
    cpu_linear_kernel: str = "auto"
    cpu_brgemm_linear: str = "auto"
    device: str = "auto"
    load_format: str = "safetensors"
    otlp_traces_endpoint: str | None = None
    trace_file: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    telemetry_record: str | None = None
    step_delay_ms: float = 0.0
    collect_detailed_traces: str | None = None
    inject_fault: str | None = None
    structured_outputs_config: dict[str, Any] | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, serving: bool = False) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM's names) to ``parser``, grouped by sub-config.

        ``serving``: also the flags of ``vllm serve``'s frontend that live in the config here
        (``--enable-log-requests``, ``--max-log-len``). Every known vLLM flag Glassbox does
        not implement is registered too: accepted-and-ignored ones log a note, refused ones
        exit with status 2 naming the flag (``add_vllm_compat_flags``).
        """
        d = EngineArgs()
        g = parser.add_argument_group("ModelConfig")
        g.add_argument(
            "--model",
            default=None,
            help="Local Hugging Face model directory (default: the bundled tiny model).",
        )
        g.add_argument(
            "--tokenizer", default=None, help="Tokenizer directory (default: the model directory)."
        )
        g.add_argument(
            "--dtype",
            default=d.dtype,
            choices=DTYPES,
            help="Weight and activation dtype; auto = the checkpoint's (float16 → bfloat16 on CPU).",
        )
        g.add_argument("--seed", type=int, default=d.seed, help="Random seed of the worker.")
        g.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="Longest prompt + output, in tokens (default: the model's max_position_embeddings).",
        )
        g.add_argument(
            "--served-model-name",
            default=None,
            help="Model name reported to clients (default: the model as given; glassbox-tiny-llama for the bundled one).",
        )
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="Run the model eagerly: no torch.compile (the readable reference path; starts faster, "
            "steps slower).",
        )
        g.add_argument(
            "--attention-backend",
            default=None,
            metavar="{TORCH_SDPA,PAGED_INDUCTOR,CPU_PAGED_CPP}",
            help="How attention reads the paged KV cache: CPU_PAGED_CPP (CPU only; the default on "
            "a CPU) reads decode keys and values in place through a hand-written C++ kernel (vLLM's "
            "CPU paged_attention_v1; built with g++ on the first start, cached); TORCH_SDPA (the "
            "default elsewhere, and on a CPU without a C++ compiler) gathers each request's pages "
            "and calls SDPA; PAGED_INDUCTOR reads decode keys in place through a kernel compiled "
            "by Inductor.",
        )
        g.add_argument(
            "--cpu-bf16-linear",
            default=d.cpu_bf16_linear,
            choices=CPU_BF16_MODES,
            help="How a bfloat16 model's linears run on a CPU: auto (the default) times oneDNN's "
            "bfloat16 matmul against the same math as a float32 matmul of upcast weights, at the "
            "model's shapes, once per CPU (cached), and takes the faster; native or upcast forces "
            "one (upcast keeps a float32 copy of every linear weight).",
        )
        g.add_argument(
            "--cpu-bf16-attention",
            default=d.cpu_bf16_attention,
            choices=CPU_BF16_MODES,
            help="How a bfloat16 model's prefill attention runs on a CPU: auto (the default) times "
            "torch's SDPA in bfloat16 against float32 at the model's heads, once per CPU (cached), "
            "and takes the faster; native or upcast forces one.",
        )
        g.add_argument(
            "--cpu-f32-linear",
            default=d.cpu_f32_linear,
            choices=CPU_F32_LINEAR_MODES,
            help="How a float32 model's linears run on a CPU at a few rows (a small decode batch): "
            "auto (the default) times torch's plain matmul against oneDNN's pre-packed one at the "
            "model's shapes at 1, 2 and 4 rows, once per CPU (cached), and runs the plain one up "
            "to the row count where it is faster; packed or plain forces one at every row count.",
        )
        g.add_argument(
            "--cpu-linear-kernel",
            default=d.cpu_linear_kernel,
            choices=CPU_LINEAR_KERNEL_MODES,
            help="Whether linears at one to four rows (decode batches of 1 to 4) run through "
            "Glassbox's own C++ matrix-vector kernel (float32 on CPUs with AVX-512, bfloat16 with "
            "AVX512-BF16; built with the C++ compiler on first use): auto (the default) times it "
            "against the library path at the model's shapes at 1, 2 and 4 rows, once per CPU "
            "(cached), and uses it up to the row count where it is faster; on or off forces it.",
        )
        g.add_argument(
            "--cpu-brgemm-linear",
            default=d.cpu_brgemm_linear,
            choices=CPU_BRGEMM_LINEAR_MODES,
            help="Whether a bfloat16 model's linears run through torch's brgemm micro-kernel "
            "(oneDNN's ukernel, AMX where the CPU has it; one kernel for every row count, where "
            "oneDNN's matmul compiles one per new count): auto (the default) times it against the "
            "library path at the model's shapes at 8 to 128 rows, once per CPU (cached), and uses "
            "it up to the row count where it is as fast; on (every row count) or off forces it.",
        )
        g.add_argument(
            "--runner",
            default=d.runner,
            choices=("auto", "generate", "pooling"),
            help="What the model serves: generate (text: the completion, chat, responses and messages "
            "routes, LLM.generate) or pooling (embeddings: /v1/embeddings, /pooling, LLM.embed); auto = "
            "generate (every architecture here is a text generator).",
        )
        g.add_argument(
            "--convert",
            default=d.convert,
            choices=("auto", "none", "embed"),
            help="Adapt the model to the runner: embed turns a decoder into an embedding model (its LM "
            "head dropped, its final hidden states pooled); auto = embed under --runner pooling.",
        )
        g.add_argument(
            "--pooler-config",
            type=_json_object('{"pooling_type": "MEAN"}'),
            default=None,
            help='JSON object: how --runner pooling pools, e.g. \'{"pooling_type": "MEAN"}\' (LAST, the '
            'default, MEAN or CLS), "use_activation": false (no normalisation), "dimensions" (a '
            "Matryoshka model's default length).",
        )
        g.add_argument(
            "--trust-remote-code",
            action="store_true",
            help="Accepted for vLLM compatibility: no code from a model directory is ever run.",
        )
        g.add_argument(
            "--tokenizer-mode",
            default=d.tokenizer_mode,
            help="auto or hf: both load the fast tokenizer (tokenizer.json), the only kind Glassbox "
            "reads; slow, mistral and custom are refused.",
        )
        g.add_argument(
            "--max-logprobs",
            type=int,
            default=d.max_logprobs,
            help="Most logprobs / prompt_logprobs a request may ask for per token (-1 = no cap).",
        )
        g.add_argument(
            "--generation-config",
            default=d.generation_config,
            help="Where the sampling params a request leaves unset come from: auto = the model's "
            "generation_config.json (temperature, top_p, top_k, min_p, the penalties, max_new_tokens; "
            "do_sample is ignored), vllm = vLLM's built-in values, or a directory holding a "
            "generation_config.json.",
        )
        g.add_argument(
            "--override-generation-config",
            type=_json_object('{"temperature": 0.5}'),
            default=None,
            help="JSON object of default sampling params laid over the generation config, e.g. '{\"temperature\": 0.5}'.",
        )
        g = parser.add_argument_group("CacheConfig")
        g.add_argument(
            "--block-size",
            type=int,
            default=d.block_size,
            choices=BLOCK_SIZES,
            help="Tokens per KV-cache block.",
        )
        g.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=d.gpu_memory_utilization,
            help="CUDA only: share of device memory for weights, activations and KV cache.",
        )
        g.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=None,
            help="KV-cache size in bytes (overrides GLASSBOX_CPU_KVCACHE_SPACE and --gpu-memory-utilization).",
        )
        g.add_argument(
            "--num-gpu-blocks-override",
            type=int,
            default=None,
            help="Use exactly this many KV blocks (testing preemption).",
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
            help="Reuse KV blocks of shared prompt prefixes (default: on; off under --runner pooling with "
            "MEAN or CLS pooling, which need every prompt token computed).",
        )
        g.add_argument(
            "--kv-cache-dtype",
            default=d.kv_cache_dtype,
            help="Only auto (the model's dtype) is supported; fp8 KV caches are refused.",
        )
        g = parser.add_argument_group("SchedulerConfig")
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=None,
            help="Most requests running at once (default 256 offline, 128 serving).",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Token budget of one scheduler step (default 4096 offline, 2048 serving).",
        )
        g.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=d.enable_chunked_prefill,
            help="Split long prompts across steps (default: on, as in vLLM V1; off under --runner pooling "
            "with MEAN or CLS pooling, which take each prompt whole).",
        )
        g.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=d.long_prefill_token_threshold,
            help="Cap each prefill chunk at this many tokens (0 = no cap).",
        )
        g.add_argument(
            "--scheduling-policy",
            default=d.scheduling_policy,
            choices=SCHEDULING_POLICIES,
            help="Order of waiting requests.",
        )
        g = parser.add_argument_group("ParallelConfig")
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="Workers per pipeline stage, each with a slice of every layer (torch.distributed: "
            "gloo on CPU, NCCL on CUDA). Must divide the attention heads.",
        )
        g.add_argument(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=1,
            help="Pipeline stages, each with a consecutive share of the decoder layers (vLLM's partition; "
            "GLASSBOX_PP_LAYER_PARTITION overrides it). At most num_hidden_layers.",
        )
        g.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=1,
            help="Engine cores, each with its own workers, plus a DPCoordinator when above 1 "
            "(across nodes: --data-parallel-size-local, --headless; docs/multi-node.md).",
        )
        g.add_argument(
            "--data-parallel-size-local",
            "-dpl",
            type=int,
            default=None,
            help="Engine cores on this node (default: all of --data-parallel-size, or on a --headless "
            "node the ranks from --data-parallel-start-rank up). Below --data-parallel-size, the other "
            "ranks run on headless nodes that join over TCP (docs/multi-node.md).",
        )
        g.add_argument(
            "--data-parallel-start-rank",
            "-dpr",
            type=int,
            default=0,
            help="The DP rank of this node's first engine core (a --headless node's; the head's is 0).",
        )
        g.add_argument(
            "--data-parallel-address",
            "-dpa",
            default=None,
            help="Multi-node DP: the head node's address; the head binds its engine sockets there "
            "(TCP) and headless nodes connect to it.",
        )
        g.add_argument(
            "--data-parallel-rpc-port",
            "-dpp",
            type=int,
            default=DEFAULT_DP_RPC_PORT,
            help="Multi-node DP: the head's first TCP port; it uses this one (headless nodes join "
            "here) and the next 2 + 2 × API servers (docs/multi-node.md lists them).",
        )
        if serving:
            g.add_argument(
                "--headless",
                action="store_true",
                help="Run this node's engine cores (ranks --data-parallel-start-rank ..) and their "
                "workers with no API server: they join the head at --data-parallel-address over TCP.",
            )
        g.add_argument(
            "--enable-expert-parallel",
            "-ep",
            action="store_true",
            help="Mixture-of-experts models: split the experts over the DP × TP ranks (whole experts on "
            "each, tokens sent to them by all-to-all) instead of each expert over TP; across DP engines "
            "every engine then steps while any has work (dummy batches join the collectives).",
        )
        g.add_argument(
            "--distributed-executor-backend",
            default=None,
            choices=EXECUTOR_BACKENDS,
            help="mp: each worker in its own process; uni: the one worker inside the engine core; "
            f"ray: each worker a Ray actor ({RAY_INSTALL_HINT}; docs/multi-node.md) "
            "(default: mp, or uni when GLASSBOX_ENABLE_MULTIPROCESSING=0 and tp × pp = 1).",
        )
        g = parser.add_argument_group("DeviceConfig / LoadConfig")
        g.add_argument(
            "--device", default=d.device, choices=DEVICES, help="auto = CUDA when present, else CPU."
        )
        g.add_argument(
            "--load-format", default=d.load_format, choices=("auto", "safetensors"), help="Weight format."
        )
        g = parser.add_argument_group("StructuredOutputsConfig")
        g.add_argument(
            "--structured-outputs-config",
            type=_json_object('{"backend": "guidance"}'),
            default=None,
            metavar="JSON",
            help='The grammar backend and its options, e.g. \'{"backend": "guidance", '
            "\"disable_any_whitespace\": true}'. backend: auto or guidance (both llguidance; vLLM's "
            "xgrammar, outlines, lm-format-enforcer are refused); disable_any_whitespace, "
            "disable_additional_properties, whitespace_pattern as in vLLM.",
        )
        g = parser.add_argument_group("ObservabilityConfig")
        g.add_argument(
            "--otlp-traces-endpoint",
            default=None,
            help="Send spans over OTLP to this collector (e.g. Jaeger at http://127.0.0.1:4318/v1/traces); "
            "also OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT. Protocol: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, "
            "else http/protobuf for a /v1/traces path or port 4318, else grpc (see docs/otlp.md).",
        )
        g.add_argument(
            "--trace-file",
            default=None,
            help="Write every finished span as a JSON line to this file (or GLASSBOX_TRACE_FILE).",
        )
        g.add_argument(
            "--collect-detailed-traces",
            default=None,
            metavar="LEVELS",
            help="Also trace inside the workers each step: model (forward and sampling spans), worker "
            "(and worker.execute_model with its broadcast-queue wait), all; comma-separated (vLLM's flag).",
        )
        g.add_argument(
            "--telemetry-record",
            default=None,
            metavar="FILE",
            help="Record every process's live telemetry to FILE (play it with engine-top --replay FILE).",
        )
        g.add_argument(
            "--step-delay-ms",
            type=float,
            default=d.step_delay_ms,
            help="Sleep this many ms after each engine step: slow motion, to watch the scheduler in engine-top.",
        )
        g.add_argument(
            "--inject-fault",
            default=None,
            metavar="SPEC",
            help="Fault injection, for teaching and tests: STAGE:KIND[@ROLE][#N], comma-separated, e.g. "
            "worker.load_model:hang@Worker_DP0_PP0_TP1; KIND: hang, freeze, gil, crash, exit:<code>, "
            "kill:<signal>, slow:<seconds> (or GLASSBOX_FAULT; see docs/faults.md).",
        )
        if serving:
            g.add_argument(
                "--enable-log-requests",
                action=argparse.BooleanOptionalAction,
                default=d.enable_log_requests,
                help="Log one line per request: its id, prompt and sampling params.",
            )
            g.add_argument(
                "--disable-log-requests",
                dest="enable_log_requests",
                action="store_const",
                const=False,
                help="vLLM's deprecated spelling of --no-enable-log-requests.",
            )
            g.add_argument(
                "--max-log-len",
                type=int,
                default=None,
                help="Cut logged prompts to this many characters or token ids (default: whole).",
            )
        g = parser.add_argument_group("Frontend")
        g.add_argument(
            "--chat-template",
            default=None,
            help="Chat template for chat requests (and LLM.chat), replacing the tokenizer's: a file "
            "path, or the Jinja template itself (default: the tokenizer's).",
        )
        add_vllm_compat_flags(parser, serving)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Copy every field that exists on the namespace (vLLM's rule); None keeps the default."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                kwargs[f.name] = value
        return cls(**kwargs)

    def create_engine_config(self, usage_context: str = "llm") -> EngineConfig:
        """Validate every value and build the ``EngineConfig``; a fixed KV budget too small
        for one request is refused here too (``check_fixed_kv_budget``).

        Raises:
            ConfigError: a value is not allowed; the message names the flag (or the
                ``GLASSBOX_*`` variable).
        """
        from engine import envs

        try:
            envs.validate_all()
        except ValueError as e:
            raise ConfigError.from_message(str(e), flag=str(e).split("=", 1)[0]) from None
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            cpu_bf16_linear=self.cpu_bf16_linear,
            cpu_bf16_attention=self.cpu_bf16_attention,
            cpu_f32_linear=self.cpu_f32_linear,
            cpu_linear_kernel=self.cpu_linear_kernel,
            cpu_brgemm_linear=self.cpu_brgemm_linear,
            served_model_name=self.served_model_name,
            trust_remote_code=self.trust_remote_code,
            tokenizer_mode=self.tokenizer_mode,
            max_logprobs=self.max_logprobs,
            generation_config_source=self.generation_config,
            override_generation_config=self.override_generation_config,
            chat_template=self.chat_template,
            runner=self.runner,
            convert=self.convert,
            pooler_config=PoolerConfig.from_json(self.pooler_config)
            if isinstance(self.pooler_config, dict)
            else self.pooler_config,
        )
        model_config.check_tokenizer_files()
        enable_chunked_prefill, enable_prefix_caching = self._chunked_prefill_and_prefix_caching(
            model_config
        )  # the frontend needs it; found before anything starts
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_start_rank=self.data_parallel_start_rank,
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            headless=self.headless,
            enable_expert_parallel=self.enable_expert_parallel,
        )
        if usage_context != "serve" and parallel_config.multi_node:
            flag = "--headless" if self.headless else "--data-parallel-size-local"
            raise ConfigError(flag, getattr(self, flag[2:].replace("-", "_")),
                              "multi-node data parallelism runs under glassbox serve (a head and headless "
                              "nodes, docs/multi-node.md), not an offline LLM")  # fmt: skip
        max_len = model_config.max_model_len
        assert max_len is not None
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = DEFAULT_MAX_NUM_BATCHED_TOKENS[usage_context]
            if not enable_chunked_prefill:
                batched = max(batched, max_len)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=self.max_num_seqs
            if self.max_num_seqs is not None
            else DEFAULT_MAX_NUM_SEQS[usage_context],
            max_model_len=max_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
        )
        config = EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(device=self.device),
            load_config=LoadConfig(load_format=self.load_format),
            structured_outputs_config=self._structured_outputs_config(),
            observability_config=ObservabilityConfig(
                otlp_traces_endpoint=self.otlp_traces_endpoint,
                trace_file=self.trace_file or envs.GLASSBOX_TRACE_FILE,
                enable_log_requests=self.enable_log_requests,
                max_log_len=self.max_log_len,
                telemetry_record=self.telemetry_record,
                collect_detailed_traces=self.collect_detailed_traces,
                step_delay_ms=self.step_delay_ms,
                inject_fault=self.inject_fault or ",".join(map(str, envs.GLASSBOX_FAULT or ())) or None,
            ),
        )
        check_fixed_kv_budget(config)
        return config

    def _chunked_prefill_and_prefix_caching(self, model_config: ModelConfig) -> tuple[bool, bool]:
        """``--enable-chunked-prefill`` and ``--enable-prefix-caching`` as given, else what the
        model supports (vLLM's ``_set_default_chunked_prefill_and_prefix_caching_args``: both on,
        but off for MEAN and CLS pooling).

        Deliberate deviation: vLLM only warns when either is forced on for MEAN or CLS pooling
        (and a chunked prompt then fails in the pooler, a cached prefix pools wrong); Glassbox
        refuses the flag, as it refuses ``--long-prefill-token-threshold``, which splits
        prompts too.

        Raises:
            ConfigError: one of the three flags splits or skips prompts MEAN/CLS pooling needs whole.
        """
        supported = model_config.is_chunked_prefill_supported  # the same rule for prefix caching
        chunked = supported if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        caching = supported if self.enable_prefix_caching is None else self.enable_prefix_caching
        if not supported:
            pooling = model_config.pooler_config.seq_pooling_type
            why = f"{pooling} pooling needs every prompt token computed in one step (--runner pooling)"
            if chunked:
                raise ConfigError("--enable-chunked-prefill", True, why)
            if caching:
                raise ConfigError("--enable-prefix-caching", True, why)
            if self.long_prefill_token_threshold:
                raise ConfigError("--long-prefill-token-threshold", self.long_prefill_token_threshold, why)
        return chunked, caching

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        """``--structured-outputs-config``'s JSON as a ``StructuredOutputsConfig``."""
        return StructuredOutputsConfig.from_json(dict(self.structured_outputs_config or {}))

"""Engine flags: one dataclass field per CLI flag, and the ``EngineConfig`` built from them.

Mirrors vLLM's ``vllm/engine/arg_utils.py`` (``EngineArgs``, ``add_cli_args``,
``from_cli_args``, ``create_engine_config``). Flag names are ``vllm serve``'s. Building the
config validates everything (``ConfigError`` names the flag) and imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import (
    BLOCK_SIZES,
    DEFAULT_MODEL,
    DEVICES,
    DTYPES,
    EXECUTOR_BACKENDS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)

# vLLM's CPU defaults for the offline LLM class (FACTS §2.3), scaled by world size 1.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"llm": 4096, "serve": 2048}
DEFAULT_MAX_NUM_SEQS = {"llm": 256, "serve": 128}


@dataclass
class EngineArgs:
    """Every engine flag with its default. ``None`` means "work it out" (see each help)."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False
    device: str = "auto"
    load_format: str = "safetensors"
    otlp_traces_endpoint: str | None = None
    trace_file: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM's names) to ``parser``, grouped by sub-config."""
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
            help="Never use torch.compile (it is opt-in anyway: GLASSBOX_TORCH_COMPILE=1).",
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
            help="Reuse KV blocks of shared prompt prefixes.",
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
            help="Split long prompts across steps (on by default, as in vLLM V1).",
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
            help="Workers per pipeline stage (1 in this version).",
        )
        g.add_argument(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=1,
            help="Pipeline stages (1 in this version).",
        )
        g.add_argument(
            "--data-parallel-size", "-dp", type=int, default=1, help="Engine cores (1 in this version)."
        )
        g.add_argument(
            "--distributed-executor-backend",
            default=None,
            choices=EXECUTOR_BACKENDS,
            help="uni: the worker runs inside the engine core.",
        )
        g = parser.add_argument_group("DeviceConfig / LoadConfig")
        g.add_argument(
            "--device", default=d.device, choices=DEVICES, help="auto = CUDA when present, else CPU."
        )
        g.add_argument(
            "--load-format", default=d.load_format, choices=("auto", "safetensors"), help="Weight format."
        )
        g = parser.add_argument_group("ObservabilityConfig")
        g.add_argument(
            "--otlp-traces-endpoint",
            default=None,
            help="Send spans over OTLP to this collector (e.g. Jaeger).",
        )
        g.add_argument(
            "--trace-file",
            default=None,
            help="Write every finished span as a JSON line to this file (or GLASSBOX_TRACE_FILE).",
        )
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
        """Validate every value and build the ``EngineConfig``.

        Raises:
            ConfigError: a value is not allowed; the message names the flag.
        """
        from engine import envs

        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            served_model_name=self.served_model_name,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        max_len = model_config.max_model_len
        assert max_len is not None
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = DEFAULT_MAX_NUM_BATCHED_TOKENS[usage_context]
            if not self.enable_chunked_prefill:
                batched = max(batched, max_len)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=self.max_num_seqs
            if self.max_num_seqs is not None
            else DEFAULT_MAX_NUM_SEQS[usage_context],
            max_model_len=max_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(device=self.device),
            load_config=LoadConfig(load_format=self.load_format),
            observability_config=ObservabilityConfig(
                otlp_traces_endpoint=self.otlp_traces_endpoint,
                trace_file=self.trace_file or envs.GLASSBOX_TRACE_FILE,
            ),
        )

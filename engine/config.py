"""``EngineConfig`` and its sub-configs.

Mirrors vLLM's ``vllm/config/`` (``VllmConfig`` → our ``EngineConfig``). Each sub-config
validates its own fields in ``__post_init__`` and raises ``ConfigError`` naming the CLI flag,
the value and what is allowed, so the CLI can print one line and exit 2. Nothing here
imports torch: ``dtype="auto"`` and ``device="auto"`` are resolved by the worker and
reported back; the model's ``config.json`` is read as plain JSON.

Left out: LoRA, speculative decoding, quantization, multimodal, KV transfer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The default model ships with the package (made by scripts/make_default_model.py).
DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "default_model")
DEFAULT_SERVED_NAME = "glassbox-tiny-llama"

# Architectures the model code implements (config.json "architectures").
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp")


class ConfigError(ValueError):
    """A configuration value is not allowed.

    ``str(err)`` is one line: ``--flag: invalid value V (allowed: ...)``.
    """

    def __init__(self, flag: str, value: Any, allowed: str) -> None:
        self.flag = flag
        self.value = value
        self.allowed = allowed
        super().__init__(f"{flag}: invalid value {value!r} ({allowed})")


def _positive_int(flag: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(flag, value, "must be a positive integer")


@dataclass
class ModelConfig:
    """The model: where it is, its shape (read from ``config.json``), dtype and limits.

    Attributes filled from the checkpoint: ``architecture``, ``hf_config`` (the whole
    ``config.json`` as a dict), ``generation_config`` (``generation_config.json`` or {}),
    ``eos_token_id`` (primary EOS id) and ``max_model_len`` when not given.

    Raises:
        ConfigError: missing directory or ``config.json``, unsupported architecture,
            bad dtype, ``max_model_len`` above the model's position limit.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False
    served_model_name: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    generation_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        path = Path(self.model).expanduser()
        if not path.is_dir():
            raise ConfigError("--model", self.model, "must be a local Hugging Face model directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError("--model", self.model, "the directory has no config.json")
        given = self.model
        self.model = str(path.resolve())
        if self.tokenizer is None:
            self.tokenizer = self.model
        elif not Path(self.tokenizer).expanduser().is_dir():
            raise ConfigError("--tokenizer", self.tokenizer, "must be a local tokenizer directory")
        try:
            self.hf_config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("--model", self.model, f"config.json is unreadable: {e}") from None
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                self.generation_config = json.loads(gen_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError("--model", self.model, f"bad generation_config.json: {e}") from None
        archs = self.hf_config.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ConfigError(
                "--model",
                self.model,
                f"architecture {archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", self.dtype, f"allowed: {', '.join(DTYPES)}")
        if not isinstance(self.seed, int):
            raise ConfigError("--seed", self.seed, "must be an integer")
        limit = self.max_position_embeddings
        _positive_int("--max-model-len", self.max_model_len)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError(
                "--max-model-len",
                self.max_model_len,
                f"must be at most the model's max_position_embeddings={limit}",
            )
        if self.served_model_name is None:
            # vLLM serves a model under the name it was given; the bundled one has a short name.
            bundled = self.model == str(Path(DEFAULT_MODEL).resolve())
            self.served_model_name = DEFAULT_SERVED_NAME if bundled else given

    @property
    def architecture(self) -> str:
        return next(a for a in self.hf_config["architectures"] if a in SUPPORTED_ARCHITECTURES)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_key_value_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id: config.json's, else the first of generation_config's."""
        for source in (self.hf_config, self.generation_config):
            eos = source.get("eos_token_id")
            if isinstance(eos, int):
                return eos
            if isinstance(eos, list) and eos:
                return int(eos[0])
        return None

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the weights were saved in (``torch_dtype`` / ``dtype`` in config.json)."""
        return str(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32")


@dataclass
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` is filled in after the worker profiled memory (including block 0,
    the null block). On CPU the budget is ``GLASSBOX_CPU_KVCACHE_SPACE`` GiB unless
    ``kv_cache_memory_bytes`` is set; on CUDA it is ``gpu_memory_utilization`` of the
    device minus weights and activations.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("--block-size", self.block_size, f"allowed: {', '.join(map(str, BLOCK_SIZES))}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ConfigError("--gpu-memory-utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _positive_int("--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 2
        ):
            raise ConfigError(
                "--num-gpu-blocks-override",
                self.num_gpu_blocks_override,
                "must be at least 2 (block 0 is the null block)",
            )


@dataclass
class ParallelConfig:
    """How the model is split across workers (``world_size = tp × pp``) and engines (dp).

    ``distributed_executor_backend``: "mp" runs each worker in its own process (the default,
    so the whole tree can be watched — vLLM defaults to "uni" at world size 1); "uni" keeps
    the single worker inside the engine core. With ``GLASSBOX_ENABLE_MULTIPROCESSING=0`` the
    default is "uni": everything in the caller's process.
    Tensor, pipeline and data parallel sizes above 1 are validated and refused for now.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        _positive_int("--tensor-parallel-size", self.tensor_parallel_size, allow_none=False)
        _positive_int("--pipeline-parallel-size", self.pipeline_parallel_size, allow_none=False)
        _positive_int("--data-parallel-size", self.data_parallel_size, allow_none=False)
        if self.distributed_executor_backend is None:
            from engine import envs

            self.distributed_executor_backend = "mp" if envs.GLASSBOX_ENABLE_MULTIPROCESSING else "uni"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                "--distributed-executor-backend",
                self.distributed_executor_backend,
                f"allowed: {', '.join(EXECUTOR_BACKENDS)}",
            )
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ):
            if value != 1:
                raise ConfigError(flag, value, "only 1 is supported in this version")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class SchedulerConfig:
    """The token budget and limits of each scheduler step.

    ``max_num_batched_tokens`` is the per-step token budget; ``max_num_seqs`` the most
    requests running at once; a prefill longer than ``long_prefill_token_threshold``
    (when > 0) is chunked to that size each step.
    """

    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive_int("--max-num-batched-tokens", self.max_num_batched_tokens, allow_none=False)
        _positive_int("--max-num-seqs", self.max_num_seqs, allow_none=False)
        _positive_int("--max-model-len", self.max_model_len, allow_none=False)
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "--long-prefill-token-threshold", self.long_prefill_token_threshold, "must be >= 0"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                "--scheduling-policy", self.policy, f"allowed: {', '.join(SCHEDULING_POLICIES)}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "--max-num-batched-tokens",
                self.max_num_batched_tokens,
                f"must be >= --max-model-len ({self.max_model_len}) when chunked prefill is disabled",
            )


@dataclass
class DeviceConfig:
    """Where the worker runs: "auto" picks CUDA when present, else CPU (resolved by the worker)."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("--device", self.device, f"allowed: {', '.join(DEVICES)}")


@dataclass
class LoadConfig:
    """How weights are read. Only local safetensors in Hugging Face layout."""

    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors"):
            raise ConfigError("--load-format", self.load_format, "allowed: auto, safetensors")


@dataclass
class ObservabilityConfig:
    """Tracing. ``trace_file``: every finished span as one JSON line (Glassbox addition)."""

    otlp_traces_endpoint: str | None = None
    trace_file: str | None = None


@dataclass
class EngineConfig:
    """The whole configuration, passed whole to every process (vLLM: ``VllmConfig``)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig | None = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        max_len = self.model_config.max_model_len
        if self.scheduler_config is None:
            self.scheduler_config = SchedulerConfig(max_model_len=max_len)
        else:
            self.scheduler_config.max_model_len = max_len
            self.scheduler_config.__post_init__()
        tp = self.parallel_config.tensor_parallel_size
        if self.model_config.num_attention_heads % tp:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide the number of attention heads ({self.model_config.num_attention_heads})",
            )
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

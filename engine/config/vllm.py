"""``EngineConfig``: the whole configuration, passed whole to every process.

vLLM's counterpart is ``VllmConfig`` in ``vllm/config/vllm.py``. Its ``__post_init__`` holds
the checks that need two sub-configs at once: the scheduler's ``max_model_len``, the block
override against one request, TP against the model's heads, PP against its layers, the
attention backend against the device, and the weights present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.cache import CacheConfig, too_few_blocks_reason
from engine.config.device import DeviceConfig
from engine.config.load import LoadConfig
from engine.config.model import ModelConfig
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import ParallelConfig
from engine.config.scheduler import SchedulerConfig
from engine.config.structured_outputs import StructuredOutputsConfig
from engine.config.utils import ConfigError


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
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        max_len = self.model_config.max_model_len
        if self.scheduler_config is None:
            self.scheduler_config = SchedulerConfig(max_model_len=max_len)
        else:
            self.scheduler_config.max_model_len = max_len
            self.scheduler_config.__post_init__()
        # Checked here, in the first process, so it fails before anything is spawned (the
        # engine core checks it again where the cache is sized).
        override = self.cache_config.num_gpu_blocks_override
        if override is not None and max_len is not None:
            needed = -(-max_len // self.cache_config.block_size) + 1
            if override < needed:
                raise ConfigError(
                    "--num-gpu-blocks-override", override, too_few_blocks_reason(max_len, needed)
                )
        self._check_tensor_parallel_size()
        self._check_pipeline_parallel_size()
        if self.model_config.attention_backend == "CPU_PAGED_CPP" and self.device_config.device == "cuda":
            # With --device auto the device is known only in the worker: set_attention_backend
            # refuses it there.
            raise ConfigError(
                "--attention-backend",
                "CPU_PAGED_CPP",
                "its kernel runs on the CPU only, and --device is cuda; use TORCH_SDPA or PAGED_INDUCTOR",
            )
        if not any(Path(self.model_config.model).glob("*.safetensors")):
            # Found here, not by the worker after the whole tree has started.
            raise ConfigError(
                "--model", self.model_config.model, "the directory has no *.safetensors weights"
            )
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def _check_tensor_parallel_size(self) -> None:
        """Refuse, in the first process, a TP size that does not split the model evenly.

        Query heads and MLP columns must divide by TP. KV heads must too — or, when TP is
        larger, TP must be a multiple of them: each KV head is then replicated on
        ``tp / num_kv_heads`` ranks (vLLM's rule).
        """
        tp = self.parallel_config.tensor_parallel_size
        if tp == 1:
            return
        model = self.model_config
        heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
        if heads % tp:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide the number of attention heads ({heads}) of {model.model}",
            )
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide the number of KV heads ({kv_heads}) of {model.model}, "
                "or be a multiple of it (each KV head then replicated)",
            )
        intermediate = int(model.hf_config.get("intermediate_size") or 0)
        if intermediate % tp:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide intermediate_size ({intermediate}) of {model.model}",
            )

    def _check_pipeline_parallel_size(self) -> None:
        """Refuse, in the first process, a PP size or layer partition that does not fit the model.

        Every stage needs at least one decoder layer; ``GLASSBOX_PP_LAYER_PARTITION``, when
        set, must give one count per stage summing to ``num_hidden_layers``.
        """
        from engine.distributed.utils import PARTITION_ENV, get_pp_partition

        pp = self.parallel_config.pipeline_parallel_size
        layers = self.model_config.num_hidden_layers
        try:
            get_pp_partition(layers, pp)
        except ValueError as e:
            if os.environ.get(PARTITION_ENV):
                reason = str(e).split(": ", 1)[-1]  # the variable and value are named already
                raise ConfigError(PARTITION_ENV, os.environ[PARTITION_ENV], reason) from None
            raise ConfigError(
                "--pipeline-parallel-size",
                pp,
                f"must not exceed num_hidden_layers ({layers}) of {self.model_config.model}",
            ) from None

    def max_layers_per_stage(self) -> int:
        """The most decoder layers any pipeline stage holds (its workers need the most KV memory)."""
        from engine.distributed.utils import get_pp_partition

        return max(
            get_pp_partition(self.model_config.num_hidden_layers, self.parallel_config.pipeline_parallel_size)
        )

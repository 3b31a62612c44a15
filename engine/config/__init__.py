"""``EngineConfig`` and its sub-configs, one module each, as vLLM's ``vllm/config/`` package.

==================  ==========================  ==================================
module              classes                     vLLM 0.32
==================  ==========================  ==================================
``model.py``        ``ModelConfig``             ``vllm/config/model.py``
``cache.py``        ``CacheConfig``             ``vllm/config/cache.py``
``parallel.py``     ``ParallelConfig``          ``vllm/config/parallel.py``
``scheduler.py``    ``SchedulerConfig``         ``vllm/config/scheduler.py``
``device.py``       ``DeviceConfig``            ``vllm/config/device.py``
``load.py``         ``LoadConfig``              ``vllm/config/load.py``
``observability.py`` ``ObservabilityConfig``    ``vllm/config/observability.py``
``pooler.py``       ``PoolerConfig``            ``vllm/config/pooler.py``
``structured_outputs.py`` ``StructuredOutputsConfig``  ``vllm/config/structured_outputs.py``
``vllm.py``         ``EngineConfig``            ``VllmConfig``, ``vllm/config/vllm.py``
``utils.py``        ``ConfigError``             ``vllm/config/utils.py``
==================  ==========================  ==================================

Each sub-config validates its own fields in ``__post_init__`` and raises ``ConfigError``
naming the CLI flag, the value and what is allowed, so the CLI can print one line and exit
2; ``EngineConfig`` checks what needs two of them at once. Nothing here imports torch:
``dtype="auto"`` and ``device="auto"`` are resolved by the worker and reported back; the
model's ``config.json`` is read as plain JSON. Every name is re-exported here, so callers
write ``from engine.config import X`` as before the split.

Left out: LoRA, speculative decoding, quantization, multimodal, KV transfer.
"""

from __future__ import annotations

from engine.config.cache import BLOCK_SIZES, KV_CACHE_DTYPES, CacheConfig, too_few_blocks_reason
from engine.config.device import DEVICES, DeviceConfig
from engine.config.load import LoadConfig
from engine.config.model import (
    ATTENTION_BACKENDS,
    CPU_BF16_MODES,
    CPU_BRGEMM_LINEAR_MODES,
    CPU_F32_LINEAR_MODES,
    CPU_LINEAR_KERNEL_MODES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MODEL,
    DEFAULT_SERVED_NAME,
    DTYPES,
    GENERATION_CONFIG_SAMPLING_KEYS,
    MOE_MODEL,
    MOE_SERVED_NAME,
    SUPPORTED_ARCHITECTURES,
    TOKENIZER_MODES,
    ModelConfig,
    load_chat_template,
)
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import (
    DEFAULT_DP_RPC_PORT,
    EXECUTOR_BACKENDS,
    RAY_INSTALL_HINT,
    ParallelConfig,
    check_ray_address,
    ray_is_installed,
)
from engine.config.pooler import SEQ_POOLING_TYPES, PoolerConfig
from engine.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from engine.config.structured_outputs import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig
from engine.config.utils import ConfigError
from engine.config.vllm import EngineConfig

__all__ = [
    "STRUCTURED_OUTPUT_BACKENDS",
    "StructuredOutputsConfig",
    "ATTENTION_BACKENDS",
    "BLOCK_SIZES",
    "CPU_BF16_MODES",
    "CPU_BRGEMM_LINEAR_MODES",
    "CPU_F32_LINEAR_MODES",
    "CPU_LINEAR_KERNEL_MODES",
    "DEFAULT_DP_RPC_PORT",
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_MODEL",
    "MOE_MODEL",
    "MOE_SERVED_NAME",
    "DEFAULT_SERVED_NAME",
    "DEVICES",
    "DTYPES",
    "EXECUTOR_BACKENDS",
    "GENERATION_CONFIG_SAMPLING_KEYS",
    "KV_CACHE_DTYPES",
    "RAY_INSTALL_HINT",
    "SCHEDULING_POLICIES",
    "SEQ_POOLING_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "TOKENIZER_MODES",
    "CacheConfig",
    "ConfigError",
    "DeviceConfig",
    "EngineConfig",
    "LoadConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "PoolerConfig",
    "SchedulerConfig",
    "check_ray_address",
    "load_chat_template",
    "ray_is_installed",
    "too_few_blocks_reason",
]

"""``CacheConfig``: the paged KV cache's block size and memory budget.

vLLM's counterpart is ``vllm/config/cache.py``. The number of blocks is filled in after the
workers profiled memory (``engine/kv_cache/kv_cache_planning.py``).

Left out: fp8 KV caches (``--kv-cache-dtype`` takes ``auto`` only) and swap space (preempted
requests are recomputed, as in vLLM V1).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.utils import ConfigError, check_positive_int

BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto",)  # the KV cache is kept in the model's dtype; fp8 caches are left out


def too_few_blocks_reason(max_model_len: int, needed: int) -> str:
    """Why ``--num-gpu-blocks-override`` cannot hold one request of ``max_model_len``."""
    return f"too small: one request of --max-model-len {max_model_len} needs {needed} blocks, null block included"


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
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                "--kv-cache-dtype",
                self.cache_dtype,
                "Glassbox does not support it: only auto, the model's dtype (fp8 KV caches are left out)",
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("--block-size", self.block_size, f"allowed: {', '.join(map(str, BLOCK_SIZES))}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ConfigError("--gpu-memory-utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        check_positive_int("--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 2
        ):
            raise ConfigError(
                "--num-gpu-blocks-override",
                self.num_gpu_blocks_override,
                "must be at least 2 (block 0 is the null block)",
            )

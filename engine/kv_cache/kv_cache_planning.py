"""How many KV blocks fit, and whether one full-length request fits at all.

Mirrors vLLM's ``get_kv_cache_configs`` / ``check_enough_kv_cache_memory``
(``vllm/v1/core/kv_cache_utils.py``; ``kv_cache_planning.py`` in 0.33) for one group of
full-attention layers: ``num_blocks = available_bytes // (page_size_bytes × num_layers)``,
unless ``--num-gpu-blocks-override`` says otherwise. With several workers each reports its
own budget and page shape (pipeline stages hold different numbers of layers), and every
worker gets the smallest block count any of them can hold (``get_kv_cache_configs``).

``check_fixed_kv_budget`` runs the same check in the first process, before anything is
spawned, when the budget is known without a device (vLLM checks only in the engine core).
"""

from __future__ import annotations

import os

from engine.config import ConfigError, EngineConfig, too_few_blocks_reason
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig, kv_cache_spec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_enough_kv_cache_memory(config: EngineConfig, spec: FullAttentionSpec, available_bytes: int) -> None:
    """Fail fast when one ``max_model_len`` request cannot fit in the cache.

    Raises:
        ConfigError (a ValueError): no memory at all, or too little for one request; the
            message gives the largest ``--max-model-len`` that would fit and the flags to change.
    """
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None
    if available_bytes <= 0:
        raise ConfigError.from_message(
            "No available memory for the cache blocks. Raise GLASSBOX_CPU_KVCACHE_SPACE, "
            "--kv-cache-memory-bytes or --gpu-memory-utilization.",
            flag="--kv-cache-memory-bytes",
        )
    # One request needs cdiv(max_model_len, block_size) blocks, plus block 0 (the null block).
    needed = (cdiv(max_model_len, spec.block_size) + 1) * spec.bytes_per_block
    if needed > available_bytes:
        fits_blocks = max(available_bytes // spec.bytes_per_block - 1, 0)
        # Blame the budget the user set, else the length (the budget is then a default).
        if config.cache_config.kv_cache_memory_bytes:
            flag = "--kv-cache-memory-bytes"
        elif config.cache_config.num_gpu_blocks_override is None and config.device_config.device != "cuda":
            flag = (
                "GLASSBOX_CPU_KVCACHE_SPACE"
                if os.environ.get("GLASSBOX_CPU_KVCACHE_SPACE")
                else "--max-model-len"
            )
        else:
            flag = "--max-model-len"
        raise ConfigError.from_message(
            f"{flag}: to serve at least one request with --max-model-len {max_model_len}, "
            f"{needed / (1 << 20):.2f} MiB ({needed} bytes) of KV cache is needed, which is larger "
            f"than the available KV cache memory ({available_bytes / (1 << 20):.2f} MiB, "
            f"{available_bytes} bytes). The estimated maximum model length is "
            f"{fits_blocks * spec.block_size} ({fits_blocks} blocks of {spec.block_size} tokens "
            "beside the null block). Try a smaller "
            "--max-model-len or a larger GLASSBOX_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes.",
            flag=flag,
        )


def fixed_kv_cache_plan(config: EngineConfig) -> tuple[FullAttentionSpec, int] | None:
    """The page shape and the bytes for the KV cache, when both are known without a device.

    That is with a fixed budget: ``--kv-cache-memory-bytes``, or ``GLASSBOX_CPU_KVCACHE_SPACE``
    with ``--device cpu``. The page shape then follows from ``config.json`` and the dtype alone
    (``kv_cache_spec``, as each worker reports it), for the stage holding the most layers, and
    the engine core will size the cache at ``available // spec.bytes_per_block`` blocks. None
    when the device measures the budget (CUDA profiling) or ``--num-gpu-blocks-override``
    decides the count.
    """
    cache = config.cache_config
    if cache.num_gpu_blocks_override is not None:
        return None  # the override decides the block count; EngineConfig checked it
    if cache.kv_cache_memory_bytes:
        available = cache.kv_cache_memory_bytes
    elif config.device_config.device == "cpu":
        from engine import envs

        available = int(envs.GLASSBOX_CPU_KVCACHE_SPACE * (1 << 30))
    else:
        return None
    model = config.model_config
    dtype = model.checkpoint_dtype if model.dtype == "auto" else model.dtype
    spec = kv_cache_spec(
        model,
        block_size=cache.block_size,
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        num_layers=config.max_layers_per_stage(),
        dtype_size=4 if dtype in ("float32", "float") else 2,  # float16 on a CPU runs as bfloat16: 2 too
    )
    return spec, available


def check_fixed_kv_budget(config: EngineConfig) -> None:
    """Refuse, before anything is spawned, a fixed KV budget too small for one request.

    The budget and page shape are ``fixed_kv_cache_plan``'s. A budget measured on the device
    (CUDA profiling) is checked by the engine core, which raises the same ``ConfigError``.

    Raises:
        ConfigError (a ValueError): see ``check_enough_kv_cache_memory``.
    """
    plan = fixed_kv_cache_plan(config)
    if plan is not None:
        check_enough_kv_cache_memory(config, *plan)


def get_kv_cache_config(
    config: EngineConfig, spec: FullAttentionSpec, available_bytes: list[int]
) -> KVCacheConfig:
    """Size the cache from each worker's budget (the minimum wins).

    Raises:
        ConfigError (a ValueError): see ``check_enough_kv_cache_memory``; also when the
            block override leaves too few blocks for one ``max_model_len`` request (the
            first process checks that too, before anything is spawned).
    """
    available = min(available_bytes)
    override = config.cache_config.num_gpu_blocks_override
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None
    if override is not None:
        # Block 0 is the null block; one request needs cdiv(max_model_len, block_size) more.
        needed = cdiv(max_model_len, spec.block_size) + 1
        if override < needed:
            raise ConfigError(
                "--num-gpu-blocks-override", override, too_few_blocks_reason(max_model_len, needed)
            )
        num_blocks = override
    else:
        check_enough_kv_cache_memory(config, spec, available)
        num_blocks = available // spec.bytes_per_block
    return KVCacheConfig(num_blocks=num_blocks, spec=spec)


def get_kv_cache_configs(
    config: EngineConfig, specs: list[FullAttentionSpec], available_bytes: list[int]
) -> list[KVCacheConfig]:
    """One config per worker (rank order), all with the same number of blocks.

    Workers may differ in their page shapes: with pipeline parallelism each holds the KV of
    its own stage's layers only, so a block costs ``bytes_per_block`` of *that* stage. Every
    worker must fit the same block count (the scheduler hands out one set of block ids), so
    the count is the minimum over workers of ``available // bytes_per_block``. vLLM:
    ``get_kv_cache_configs``.

    Raises:
        ConfigError: as ``get_kv_cache_config``, for the worker that fits the fewest blocks.
    """
    if len(specs) != len(available_bytes):
        raise ValueError(f"{len(specs)} KV cache specs but {len(available_bytes)} memory budgets")
    fewest = min(range(len(specs)), key=lambda r: available_bytes[r] // specs[r].bytes_per_block)
    num_blocks = get_kv_cache_config(config, specs[fewest], [available_bytes[fewest]]).num_blocks
    return [KVCacheConfig(num_blocks=num_blocks, spec=spec) for spec in specs]

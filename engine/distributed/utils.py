"""Which decoder layers each pipeline stage holds (vLLM: ``vllm/distributed/utils.py``).

``get_pp_indices(num_hidden_layers, pp_rank, pp_size) -> (start, end)``: stage ``pp_rank``
runs layers ``[start, end)``. Without ``GLASSBOX_PP_LAYER_PARTITION`` the layers are split
into equal parts and the remainder goes one layer each to the stages *before* the last,
nearest the last first (10 layers over 4 stages → 2, 3, 3, 2): the last stage also runs the
final norm, the LM head and the sampler, so it gets no extra layer. With
``GLASSBOX_PP_LAYER_PARTITION="3,1"`` the counts are given (one per stage, summing to
``num_hidden_layers``).

Torch-free: the first process checks the partition before anything is spawned.
"""

from __future__ import annotations

from engine import envs

PARTITION_ENV = "GLASSBOX_PP_LAYER_PARTITION"


def get_pp_partition(num_hidden_layers: int, pp_size: int) -> list[int]:
    """Layers per stage, in stage order.

    Raises:
        ValueError: ``pp_size`` exceeds the layers (a stage would hold none), or
            ``GLASSBOX_PP_LAYER_PARTITION`` is malformed, has not one count per stage, or does not
            sum to ``num_hidden_layers`` (the message names the variable).
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    given = envs.get(PARTITION_ENV)  # parsed; a malformed value raises, naming the variable
    if given is not None:
        if len(given) != pp_size:
            raise ValueError(
                f"{PARTITION_ENV}={','.join(map(str, given))!r}: has {len(given)} stage(s), "
                f"pipeline_parallel_size is {pp_size}"
            )
        if sum(given) != num_hidden_layers:
            raise ValueError(
                f"{PARTITION_ENV}={','.join(map(str, given))!r}: sums to {sum(given)} layers, "
                f"the model has {num_hidden_layers}"
            )
        return list(given)
    if pp_size > num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} exceeds the model's {num_hidden_layers} layers "
            "(each stage needs at least one)"
        )
    partition = [num_hidden_layers // pp_size] * pp_size
    for i in range(num_hidden_layers % pp_size):
        partition[-2 - i] += 1  # the stages before the last, nearest it first
    return partition


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``(start, end)``: stage ``pp_rank`` runs decoder layers ``start .. end - 1``."""
    partition = get_pp_partition(num_hidden_layers, pp_size)
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]

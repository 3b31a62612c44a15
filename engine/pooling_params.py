"""Pooling parameters of one request: what a pooling model returns for a prompt.

Mirrors vLLM's ``vllm/pooling_params.py`` (``PoolingParams``, vLLM 0.32): the same field
names and defaults, and the same ``verify``: the engine's ``PoolerConfig`` fills in what the
request left unset, ``use_activation`` (normalise the embedding) defaults to True, and
``dimensions`` is refused unless the model supports Matryoshka embeddings. Pure Python (no
torch): it travels inside ``EngineCoreRequest`` and ``SchedulerOutput`` as a msgspec struct,
where a generation request carries ``SamplingParams`` instead.

A bad value raises ``ValueError`` whose message starts with the field's name (the API server
turns it into the error's ``param``), where vLLM raises ``VLLMValidationError`` naming it.

Left out: the fields of the pooling tasks Glassbox does not run (``step_tag_id``,
``returned_token_ids``, ``late_interaction_params``), and ``requires_token_ids``,
``skip_reading_prefix_cache`` and ``extra_kwargs`` (the embed task needs none of them).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import msgspec

from engine.sampling_params import RequestOutputKind
from engine.tasks import POOLING_TASKS, PoolingTask

if TYPE_CHECKING:
    from engine.config import ModelConfig

# The request fields that ``verify`` may blame (a ValueError's first word).
POOLING_FIELDS = ("dimensions", "use_activation", "task")


class PoolingParams(msgspec.Struct, omit_defaults=True, array_like=True):
    """How to pool one prompt (vLLM's ``PoolingParams``).

    Attributes:
        use_activation: normalise the embedding to unit L2 norm (the embed task's
            activation); None: the ``PoolerConfig``'s, else True.
        dimensions: keep only the first ``dimensions`` values of the embedding (before the
            normalisation, as vLLM): Matryoshka models only.
        task: the pooling task (``"embed"``); None until ``verify`` sets the model's.
        output_kind: always ``FINAL_ONLY``: a pooling request has one output.

    Raises:
        ValueError: ``output_kind`` other than ``FINAL_ONLY``, or an unknown ``task``.
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    task: PoolingTask | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task {self.task!r} is not supported; supported: {', '.join(POOLING_TASKS)}.")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError(f"output_kind must be FINAL_ONLY for pooling, got {self.output_kind!r}.")

    def clone(self) -> PoolingParams:
        """A deep copy (the input processor fills in the copy, never the caller's)."""
        return copy.deepcopy(self)

    def verify(self, model_config: ModelConfig) -> None:
        """Fill in the defaults of ``model_config.pooler_config`` and check the values
        against the model (vLLM's ``verify``: ``_merge_default_parameters``,
        ``_set_default_parameters``).

        Raises:
            ValueError: a task the model does not serve (``task ...``); ``dimensions`` for a
                model without Matryoshka embeddings, outside ``[1, embedding_size]``, or not
                one of its ``matryoshka_dimensions`` (``dimensions ...``).
        """
        supported = model_config.supported_tasks
        if self.task is None:
            self.task = "embed"
        if self.task not in supported:
            raise ValueError(
                f"task {self.task!r} is not supported by this model (supported: {', '.join(supported)})."
            )
        pooler_config = model_config.pooler_config
        if pooler_config is not None:
            if self.use_activation is None:
                self.use_activation = pooler_config.use_activation
            if self.dimensions is None:
                self.dimensions = pooler_config.dimensions
        if self.use_activation is None:
            self.use_activation = True
        if self.dimensions is not None:
            self._verify_dimensions(model_config)

    def _verify_dimensions(self, model_config: ModelConfig) -> None:
        name, size, dimensions = model_config.served_model_name, model_config.embedding_size, self.dimensions
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise ValueError(f"dimensions must be an integer, got {dimensions!r}.")
        if not model_config.is_matryoshka:
            raise ValueError(
                f"dimensions is not supported: model {name!r} does not support Matryoshka embeddings "
                f"(its config.json sets neither matryoshka_dimensions nor is_matryoshka); leave dimensions "
                f"unset (received dimensions={dimensions})."
            )
        if not 1 <= dimensions <= size:
            raise ValueError(f"dimensions must be in [1, {size}] for model {name!r}, got {dimensions}.")
        allowed = model_config.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {allowed} for model {name!r}, got {dimensions}.")

"""The tasks a served model can do: generate text, or pool its hidden states.

Mirrors vLLM's ``vllm/tasks.py``. One engine serves one kind of task, chosen by
``--runner`` (``ModelConfig.runner_type``): ``generate`` for the generation routes and
``LLM.generate``, ``pooling`` for ``/v1/embeddings``, ``/pooling``, ``LLM.embed`` and
``LLM.encode``.

Left out: vLLM's other pooling tasks (``classify``, ``token_embed``, ``token_classify``,
``plugin``) and generation tasks (``transcription``, ``realtime``): Glassbox converts its
decoders into embedding models only (``--convert embed``).
"""

from __future__ import annotations

from typing import Literal, get_args

GenerationTask = Literal["generate"]
GENERATION_TASKS: tuple[GenerationTask, ...] = get_args(GenerationTask)

PoolingTask = Literal["embed"]
POOLING_TASKS: tuple[PoolingTask, ...] = get_args(PoolingTask)

SupportedTask = Literal[GenerationTask, PoolingTask]

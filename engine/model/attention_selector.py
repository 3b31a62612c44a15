"""Which ``AttentionBackend`` a name stands for, and putting it on a model's layers.

Mirrors vLLM's ``vllm/attention/selector.py`` (``get_attn_backend``), which resolves a
backend's qualified class name the same way (``resolve_obj_by_qualname``): a backend's module
is imported only when it is chosen, so ``engine/model/attention.py`` (the reference) never
imports the faster ones in ``engine/model/cpu/``. The names are ``engine.config``'s
``ATTENTION_BACKENDS`` (the ``--attention-backend`` choices, checked without torch).
"""

from __future__ import annotations

import importlib

import torch

from engine.config import ATTENTION_BACKENDS
from engine.model.attention import Attention, AttentionBackend

_BACKENDS = {
    "TORCH_SDPA": "engine.model.attention.TorchSDPABackend",
    "PAGED_INDUCTOR": "engine.model.cpu.attention_backends.PagedInductorBackend",
    "CPU_PAGED_CPP": "engine.model.cpu.attention_backends.CPUPagedCppBackend",
}


def get_attn_backend(name: str) -> type[AttentionBackend]:
    """The backend class called ``name`` (one of ``ATTENTION_BACKENDS``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    module, _, cls = _BACKENDS[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def set_attention_backend(
    layers: list[Attention], name: str, device: torch.device | str | None = None
) -> None:
    """Prepare backend ``name`` for ``device`` (the model's, when the caller knows it) and set
    it on ``layers``. Call before warm-up: preparing may build a kernel or compile one
    (seconds the first time).

    Raises:
        ValueError: an unknown name, or a backend that cannot run on ``device``.
        RuntimeError: ``CPU_PAGED_CPP`` and no C++ compiler, or its build failed.
    """
    backend = get_attn_backend(name)
    backend.prepare(device)
    for layer in layers:
        layer.set_backend(backend)

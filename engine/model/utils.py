"""Pipeline-parallel helpers shared by the models (vLLM: ``vllm/model_executor/models/utils.py``
and ``IntermediateTensors`` from ``vllm/sequence.py``).

A model built on one pipeline stage keeps its full layout — ``model.layers`` still has
``num_hidden_layers`` entries, so parameter names match the checkpoint's — but the layers of
other stages, and the embedding / final norm / LM head it does not run, are
``PPMissingLayer`` placeholders with no parameters. ``load_weights`` skips checkpoint tensors
that land on a placeholder, so a stage reads only its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands to the next: ``{"hidden_states": (num_tokens, hidden)}``.

    vLLM's Llama also passes a separate ``"residual"`` (its fused add-RMSNorm defers each
    residual add to the next layer's norm); ours adds the residual inside each layer, so the
    hidden states already carry it and one tensor crosses the stage boundary.
    """

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class PPMissingLayer(nn.Identity):
    """A placeholder for a layer that lives on another pipeline stage (no parameters)."""


def pp_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """``("model.layers.2.", "lm_head.", ...)``: name prefixes of the modules this stage does not hold."""
    return tuple(
        prefix + "."
        for prefix, module in model.named_modules(remove_duplicate=False)
        if prefix and isinstance(module, PPMissingLayer)
    )


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a module this stage does not hold."""
    return name.startswith(pp_missing_prefixes(model))

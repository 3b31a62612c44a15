"""Build the model and fill it from a local Hugging Face checkpoint.

Mirrors vLLM's ``vllm/model_executor/model_loader/`` (``DefaultModelLoader`` with
safetensors) and the dtype/device resolution of ``vllm/config/model.py``. The module is
built directly on the target device and dtype with uninitialised parameters, then every
``*.safetensors`` file in the directory is streamed tensor by tensor into the model's
``load_weights``; a parameter that no file provided is an error, not a silent random
weight.

With tensor parallelism each worker reads only its slice: the tensors are handed to the
layers as ``LazySlice`` objects, the layer's ``weight_loader`` narrows them to its rank's
rows or columns, and only then are those bytes read from the file (safetensors
``get_slice``). A TP rank never holds a whole projection in memory. With pipeline
parallelism the model skips the tensors of other stages' layers, and with expert parallelism
the tensors of experts another rank holds: they are then never read.

Left out: ``.bin``/``.pt`` checkpoints, downloads from the Hub, quantized formats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.model.adapters import as_embedding_model
from engine.model.cpu.linear import pack_linear_weights
from engine.model.cpu.prefill_attention import tune_prefill_attention
from engine.model.registry import get_model_class

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cpu"``/``"cuda"`` as given.

    A CUDA device is ``cuda:<local_rank>`` (the worker's index on this machine).

    Raises:
        ConfigError: ``"cuda"`` was asked for and torch sees no CUDA device, or an
            unknown device name (a bad setting: the CLI reports it as one line, exit 2).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device", "cuda", "torch sees no CUDA device: torch.cuda.is_available() is False"
            )
        return torch.device("cuda", local_rank)
    if device == "cpu":
        return torch.device("cpu")
    raise ConfigError("--device", device, "allowed: auto, cpu, cuda")


def resolve_dtype(dtype: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in.

    ``"auto"`` takes the checkpoint's dtype, except float16 on CPU, which becomes bfloat16
    (float16 matmuls on CPU are slow and overflow-prone; vLLM does the same). float32
    checkpoints stay float32. An explicit dtype is used as given.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype: unknown dtype {dtype!r}")
        return _DTYPES[dtype]
    resolved = _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if resolved == torch.float16 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return resolved


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class LazySlice:
    """A checkpoint tensor not read yet: ``shape``, ``narrow(dim, start, length)``, ``load()``.

    ``narrow`` only records the range; ``load()`` reads exactly those elements from the
    file. ``default_weight_loader`` calls ``load()``; the layers' loaders narrow first.
    """

    def __init__(self, handle: Any, name: str, ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        full = tuple(self._slice.get_shape())
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in full)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        dim = dim % len(self._ranges)
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ValueError(
                f"{self._name}: narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}"
            )
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        out = LazySlice.__new__(LazySlice)
        out._handle, out._name, out._slice, out._ranges = self._handle, self._name, self._slice, tuple(ranges)
        return out

    def load(self) -> torch.Tensor:
        """Read the recorded range from the file (a CPU tensor)."""
        if not self._ranges:
            return self._handle.get_tensor(self._name)
        return self._slice[tuple(slice(start, end) for start, end in self._ranges)]


def iterate_safetensors(model_dir: str | Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Every tensor of every ``*.safetensors`` file in ``model_dir``, as (name, CPU tensor).

    With ``lazy``, each tensor is a ``LazySlice`` read only when (and as far as) a layer
    loads it.

    Raises:
        FileNotFoundError: the directory holds no ``*.safetensors`` file.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir} (only safetensors checkpoints are supported)"
        )
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() but no __iter__
                yield name, (LazySlice(f, name) if lazy else f.get_tensor(name))


def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build ``model_config.architecture`` on ``device``/``dtype`` and load its weights.

    Returns the model in eval mode.

    Raises:
        ValueError: an unsupported architecture, or parameters the checkpoint did not
            provide (all of them named).
        KeyError: a checkpoint tensor that matches no parameter.
        FileNotFoundError: no safetensors files.
    """
    from engine.distributed.parallel_state import (
        get_ep_group,
        get_pipeline_model_parallel_world_size,
        get_tensor_model_parallel_world_size,
    )

    model_class = get_model_class(model_config.architecture)
    kwargs = {}
    if model_config.convert_type == "embed":  # --runner pooling: a pooler in place of the LM head
        model_class, kwargs = as_embedding_model(model_class), {"pooler_config": model_config.pooler_config}
    with torch.device(device), _default_dtype(dtype):
        model = model_class(
            model_config.hf_config, **kwargs
        )  # this PP stage's layers, sized for this TP rank
    # Lazy: a TP rank reads only its slices, a PP stage only its own layers' tensors, an EP
    # rank only its own experts'.
    lazy = (
        get_tensor_model_parallel_world_size() > 1
        or get_pipeline_model_parallel_world_size() > 1
        or get_ep_group() is not None
    )
    loaded = model.load_weights(iterate_safetensors(model_config.model, lazy=lazy))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        names = ", ".join(model.describe_parameter(name) for name in missing)
        raise ValueError(f"checkpoint {model_config.model} is missing {len(missing)} weight(s): {names}")
    # On a CPU: oneDNN's layout, made once (vLLM: process_weights_after_loading); for a bfloat16
    # model, its linears' and prefill attention's dtype, for a float32 one its linears at a few
    # rows, and for both whether our own kernel takes the linears at a few rows (for bfloat16
    # also whether torch's brgemm micro-kernel takes them at more), measured once on this CPU.
    pack_linear_weights(model, model_config.cpu_bf16_linear, model_config.cpu_f32_linear,
                        model_config.cpu_linear_kernel, model_config.cpu_brgemm_linear)  # fmt: skip
    tune_prefill_attention(model, model_config.cpu_bf16_attention)
    return model.eval()

"""Outputs at each boundary below the frontend.

- ``ModelRunnerOutput``: worker → engine core, one per step (vLLM
  ``vllm/v1/outputs.py``).
- ``LogprobsLists``: top-N logprobs rows, plain lists so they cross processes cheaply.
- ``Float32Tensor``: a pooled vector (or any float tensor) as shape and raw float32 bytes,
  typed for msgpack: vLLM's encoder sends a tensor as its dtype, shape and buffer; ours
  fixes the dtype and the byte order, so the frontend reads it with numpy (no torch).

The per-request outputs that reach users (``RequestOutput``, ``CompletionOutput``) live in
``engine/frontend/outputs.py``; the engine-core → frontend messages in
``engine/core/messages.py``.
"""

from __future__ import annotations

import sys

import msgspec
import numpy as np


class LogprobsLists(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Logprob rows; one row per token position.

    ``logprob_token_ids[i]`` and ``logprobs[i]`` have ``num_logprobs + 1`` entries: first
    the token that was actually sampled (or, for prompt logprobs, the actual next prompt
    token), then the top ``num_logprobs`` tokens by logprob, best first.
    ``ranks[i]`` is the rank of that first token among all vocabulary entries (1 = best).
    Logprobs are of the raw model distribution (log-softmax of the logits, before
    temperature and penalties), as vLLM's default ``raw_logprobs``.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class Float32Tensor(msgspec.Struct, array_like=True, gc=False):
    """A float tensor on a process boundary: ``shape`` and ``data``, its values as
    little-endian float32 bytes in C order (``4 × prod(shape)`` bytes). A pooled embedding
    of a 1024-wide model is 4 KiB: no list of floats, no pickle.

    The worker makes one with ``from_numpy`` (of ``tensor.float().cpu().numpy()``); the
    frontend reads it with ``numpy``, which needs no torch.
    """

    shape: list[int]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Float32Tensor:
        return cls(shape=list(array.shape), data=np.ascontiguousarray(array, dtype="<f4").tobytes())

    def numpy(self) -> np.ndarray:
        """The values as a float32 array of ``shape`` in this machine's byte order (read-only
        when no conversion was needed: it views ``data``)."""
        array = np.frombuffer(self.data, dtype="<f4").reshape(self.shape)
        return array if sys.byteorder == "little" else array.astype(np.float32)


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """One step's results from the model runner.

    - ``req_ids``: the requests of this step's batch, in batch order;
      ``req_id_to_index`` maps back.
    - ``sampled_token_ids[i]``: the tokens sampled for ``req_ids[i]`` — one for a
      request whose prompt is fully computed after this step, none (empty list) for a
      prefill chunk that leaves part of the prompt for later.
    - ``logprobs[req_id]``: one row per sampled token, only for requests that asked.
    - ``prompt_logprobs_dict[req_id]``: rows for the prompt positions computed this step
      (a chunk at a time), only for requests that asked; position 0 has no logprob and is
      never included.
    - ``pooler_output[i]``: a pooling model's vector for ``req_ids[i]`` once its whole prompt
      is computed, None for a chunk that leaves part of it for later; empty for a generation
      model (whose ``sampled_token_ids`` are then all empty lists).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    prompt_logprobs_dict: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    pooler_output: list[Float32Tensor | None] = msgspec.field(default_factory=list)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])

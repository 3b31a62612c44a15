"""Outputs at each boundary below the frontend.

- ``ModelRunnerOutput``: worker → engine core, one per step (vLLM
  ``vllm/v1/outputs.py``).
- ``LogprobsLists``: top-N logprobs rows, plain lists so they cross processes cheaply.

The per-request outputs that reach users (``RequestOutput``, ``CompletionOutput``) live in
``engine/frontend/outputs.py``; the engine-core → frontend messages in
``engine/core/messages.py``.
"""

from __future__ import annotations

import msgspec


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
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    prompt_logprobs_dict: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])

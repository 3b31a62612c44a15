"""When does a request stop? The scheduler's check after each new token.

Mirrors vLLM's ``vllm/v1/core/sched/utils.py`` (``check_stop``). Stop *strings* are not
checked here: they need detokenized text, so the frontend's output processor matches them
and asks the engine to abort the request. Pure Python: no torch.
"""

from __future__ import annotations

from engine.sched.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` is done after its latest output token; set its status.

    In order:
      1. ``num_tokens >= max_model_len`` or ``num_output_tokens >= max_tokens`` →
         FINISHED_LENGTH_CAPPED (finish reason "length");
      2. fewer than ``sampling_params.min_tokens`` outputs → not done (EOS and stop ids
         are ignored until then);
      3. the last token is the EOS id, unless ``ignore_eos`` → FINISHED_STOPPED;
      4. the last token is in ``sampling_params.all_stop_token_ids`` → FINISHED_STOPPED,
         with ``request.stop_reason`` = that token id.

    Returns:
        True when the request finished (its status is then a FINISHED_* one).
    """
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True

    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False

    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False

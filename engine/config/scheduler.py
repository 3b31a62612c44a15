"""``SchedulerConfig``: the token budget and limits of each scheduler step.

vLLM's counterpart is ``vllm/config/scheduler.py``. ``max_model_len`` is copied from the
``ModelConfig`` by ``EngineConfig`` (as vLLM's ``VllmConfig`` does).

Left out: async scheduling and encoder budgets (as in ``engine/sched/scheduler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.utils import ConfigError, check_positive_int

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """The token budget and limits of each scheduler step.

    ``max_num_batched_tokens`` is the per-step token budget; ``max_num_seqs`` the most
    requests running at once; a prefill longer than ``long_prefill_token_threshold``
    (when > 0) is chunked to that size each step.
    """

    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        check_positive_int("--max-num-batched-tokens", self.max_num_batched_tokens, allow_none=False)
        check_positive_int("--max-num-seqs", self.max_num_seqs, allow_none=False)
        check_positive_int("--max-model-len", self.max_model_len, allow_none=False)
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "--long-prefill-token-threshold", self.long_prefill_token_threshold, "must be >= 0"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                "--scheduling-policy", self.policy, f"allowed: {', '.join(SCHEDULING_POLICIES)}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "--max-num-batched-tokens",
                self.max_num_batched_tokens,
                f"must be >= --max-model-len ({self.max_model_len}) when chunked prefill is disabled",
            )

"""``PoolerConfig``: how a pooling model turns its hidden states into one vector per prompt.

vLLM's counterpart is ``vllm/config/pooler.py`` (``--pooler-config``, a JSON object). A
decoder served with ``--runner pooling --convert embed`` pools the final hidden states of
each prompt (``seq_pooling_type``: the last token by default, as vLLM's converted decoders,
or the mean over the prompt, or its first token) and normalises the result to unit length
unless ``use_activation`` is false (vLLM 0.32 renamed ``normalize`` to ``use_activation``;
the old name is refused, as vLLM does).

Left out, refused with a ``ConfigError``: token-wise pooling (``ALL``, ``STEP``: the
``token_*`` tasks), classification (``logit_mean``, ``logit_sigma``), long inputs split into
chunks (``enable_chunked_processing``, ``max_embed_len``), step rewards (``step_tag_id``,
``returned_token_ids``), and Sentence Transformers' ``modules.json`` (its pooling and
projection layers are not read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from engine.config.utils import ConfigError

SequencePoolingType = Literal["CLS", "LAST", "MEAN"]
SEQ_POOLING_TYPES: tuple[SequencePoolingType, ...] = get_args(SequencePoolingType)

_FLAG = "--pooler-config"
# vLLM's fields Glassbox does not implement, and why.
_LEFT_OUT = {
    "tok_pooling_type": "token-wise pooling (ALL, STEP) is left out",
    "enable_chunked_processing": "splitting inputs longer than --max-model-len is left out",
    "max_embed_len": "splitting inputs longer than --max-model-len is left out",
    "logit_mean": "classification models are left out",
    "logit_sigma": "classification models are left out",
    "step_tag_id": "step-reward pooling is left out",
    "returned_token_ids": "step-reward pooling is left out",
    "enable_flash_late_interaction": "late-interaction scoring is left out",
}


@dataclass
class PoolerConfig:
    """How pooling works for a pooling model (vLLM: ``PoolerConfig``).

    Attributes:
        task: the pooling task; only ``"embed"`` (None: the model's, which is ``embed``).
        pooling_type: user convenience, copied into ``seq_pooling_type`` (vLLM's rule:
            not both).
        seq_pooling_type: ``LAST`` (the last prompt token's hidden state), ``MEAN`` (the
            mean over the prompt) or ``CLS`` (the first token's); None until
            ``ModelConfig`` fills in the model's default, ``LAST``.
        use_activation: normalise each embedding to unit L2 norm (None: the pooler's
            default, True).
        dimensions: the default ``dimensions`` of a request (Matryoshka models only:
            checked per request, as vLLM).

    Raises:
        ConfigError: (``--pooler-config``) a value not allowed, both ``pooling_type`` and
            ``seq_pooling_type``, or a field that is left out.
    """

    task: str | None = None
    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task != "embed":
            raise ConfigError(_FLAG, {"task": self.task}, "task: only embed (Glassbox converts decoders into "
                              "embedding models; classify and token tasks are left out)")  # fmt: skip
        for name in ("pooling_type", "seq_pooling_type"):
            value = getattr(self, name)
            if value is not None and value not in SEQ_POOLING_TYPES:
                raise ConfigError(_FLAG, {name: value}, f"{name}: allowed: {', '.join(SEQ_POOLING_TYPES)} "
                                  "(token-wise ALL and STEP are left out)")  # fmt: skip
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None:
                raise ConfigError(_FLAG, {"pooling_type": self.pooling_type},
                                  "cannot set both pooling_type and seq_pooling_type")  # fmt: skip
            self.seq_pooling_type = self.pooling_type
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ConfigError(_FLAG, {"use_activation": self.use_activation}, "use_activation: true or false")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ConfigError(_FLAG, {"dimensions": self.dimensions}, "dimensions: a positive integer")

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PoolerConfig:
        """``--pooler-config``'s JSON object → a ``PoolerConfig``.

        Raises:
            ConfigError: ``normalize`` (vLLM 0.32's message: use ``use_activation``), a field
                that is left out, or an unknown one.
        """
        if not isinstance(value, dict):
            raise ConfigError(_FLAG, value, 'must be a JSON object, e.g. \'{"pooling_type": "MEAN"}\'')
        if "normalize" in value:
            raise ConfigError(_FLAG, value, "Parameter `normalize` was removed; use `use_activation` instead")
        for name in value:
            if name in _LEFT_OUT:
                raise ConfigError(_FLAG, value, f"{name}: {_LEFT_OUT[name]}")
        known = list(cls.__dataclass_fields__)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(
                _FLAG, value, f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(known)}"
            )
        return cls(**value)

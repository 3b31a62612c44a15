"""``ModelConfig``: the model directory, its shape (read from ``config.json``), dtype and limits.

vLLM's counterpart is ``vllm/config/model.py``. Nothing here imports torch: ``dtype="auto"``
is resolved by the worker, and ``config.json`` / ``generation_config.json`` are read as plain
JSON.

The runner (``--runner``, ``--convert``, ``--pooler-config``): every architecture here is a
text generator, so ``--runner auto`` is ``generate``; ``--runner pooling`` (or ``--convert
embed``) serves the same checkpoint as an embedding model (vLLM's ``as_embedding_model``:
the LM head dropped, a pooler on the final hidden states, ``PoolerConfig``).

Left out: Hugging Face Hub downloads (the model is a local directory), remote code
(``--trust-remote-code`` changes nothing), multimodal models, native pooling architectures
and Sentence Transformers directories (``modules.json`` is not read: ``--runner auto`` never
picks pooling), ``--runner draft`` and ``--convert classify``.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.pooler import PoolerConfig
from engine.config.utils import ConfigError, check_positive_int
from engine.logger import init_logger
from engine.tasks import SupportedTask

logger = init_logger(__name__)

# The default model ships with the package (made by scripts/make_default_model.py).
DEFAULT_MODEL = str(Path(__file__).parent.parent / "assets" / "default_model")
DEFAULT_SERVED_NAME = "glassbox-tiny-llama"
# The bundled mixture of experts, upcycled from the default model (scripts/train_moe_model.py).
MOE_MODEL = str(Path(__file__).parent.parent / "assets" / "moe_model")
MOE_SERVED_NAME = "glassbox-tiny-moe"

# Architectures the model code implements (config.json "architectures").
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --attention-backend (engine/model/attention.py): the gather + SDPA reference, or decodes
# reading the paged cache in place through a kernel compiled by Inductor, or through a
# hand-written C++ kernel for CPUs (engine/model/cpu/csrc/paged_attention_cpu.cpp).
ATTENTION_BACKENDS = ("TORCH_SDPA", "PAGED_INDUCTOR", "CPU_PAGED_CPP")
# --cpu-bf16-linear / --cpu-bf16-attention: how a bfloat16 model's linears and prefill
# attention run on a CPU (engine/model/cpu/linear.py, prefill_attention.py).
CPU_BF16_MODES = ("auto", "native", "upcast")
# --cpu-f32-linear: whether a float32 model's linears at a few rows run through torch's plain
# matmul instead of oneDNN's packed one (engine/model/cpu/linear.py).
CPU_F32_LINEAR_MODES = ("auto", "packed", "plain")
# --cpu-linear-kernel: whether linears at one to four rows run through Glassbox's own C++
# kernel (engine/model/cpu/small_linear_cpu.py) instead of the library path.
CPU_LINEAR_KERNEL_MODES = ("auto", "on", "off")
# --cpu-brgemm-linear: whether a bfloat16 model's linears run through torch's brgemm
# micro-kernel (engine/model/cpu/brgemm_linear_cpu.py) instead of oneDNN's matmul primitive.
CPU_BRGEMM_LINEAR_MODES = ("auto", "on", "off")
# --runner and --convert (vLLM 0.32's RunnerOption, ConvertOption): what each runner may be
# converted with; draft (speculative decoding) and classify are left out.
RUNNER_OPTIONS = ("auto", "generate", "pooling")
CONVERT_OPTIONS = ("auto", "none", "embed")
TOKENIZER_MODES = ("auto", "hf")  # both load the fast tokenizer (tokenizer.json); the only kind here
# vLLM's default --max-logprobs (the OpenAI API's limit of top logprobs per token).
DEFAULT_MAX_LOGPROBS = 20
# What --generation-config auto takes from the model's generation_config.json, as vLLM's
# ModelConfig.get_diff_sampling_param does: these sampling fields, and max_new_tokens as the
# default max_tokens. Everything else in the file (do_sample, num_beams, ...) is ignored.
GENERATION_CONFIG_SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
# Notes already logged by this process (each config the CLI or LLM builds would repeat them).
_LOGGED_NOTES: set[str] = set()


def load_chat_template(value: str) -> str:
    """The ``--chat-template`` value → the template text, checked to parse.

    As in vLLM, the value is a file path, or — when no such file exists and it looks like
    Jinja (holds ``{``, ``}`` or a newline) — the template itself, with backslash escapes
    such as ``\\n`` decoded.

    Raises:
        ConfigError: (``--chat-template``) the file cannot be read, the value is neither a
            file nor a template, or the template does not parse.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError("--chat-template", value, "must be a file path or a Jinja template")
    shown = value if len(value) <= 60 else value[:57] + "..."
    path = Path(value).expanduser()
    is_file = False
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a long inline template is not a valid path
        pass
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("--chat-template", shown, f"cannot read the file: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
        if "\\" in text:
            text = codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")
    else:
        raise ConfigError("--chat-template", shown, "no such file, and not an inline Jinja template either")
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        # transformers adds a {% generation %} tag of its own; anything else is an error.
        if "'generation'" not in str(e.message):
            raise ConfigError(
                "--chat-template", shown, f"not a valid Jinja template: {e.message} (line {e.lineno})"
            ) from None
    return text


@dataclass
class ModelConfig:
    """The model: where it is, its shape (read from ``config.json``), dtype and limits.

    Attributes filled from the checkpoint: ``architecture``, ``hf_config`` (the whole
    ``config.json`` as a dict), ``generation_config`` (the ``generation_config.json`` in
    effect, or {}), ``eos_token_id`` (primary EOS id) and ``max_model_len`` when not given.

    ``generation_config_source`` is the ``--generation-config`` flag (vLLM's
    ``ModelConfig.generation_config``): "auto" reads the model's ``generation_config.json``
    and takes its sampling defaults; "vllm" reads it for the EOS ids only (vLLM's sampling
    defaults stay); a directory reads that directory's file instead. The defaults requests
    get are ``get_diff_sampling_param()``. ``chat_template`` holds the template text (the
    ``--chat-template`` file read, or the inline template), which replaces the tokenizer's.

    ``runner`` / ``convert`` are the flags; ``runner_type`` (``generate`` or ``pooling``) and
    ``convert_type`` (``none`` or ``embed``) what they resolve to (vLLM's names). A pooling
    model always has a ``pooler_config``, its ``seq_pooling_type`` filled in (``LAST``).

    Raises:
        ConfigError: missing directory or ``config.json``, unsupported architecture,
            bad dtype, ``max_model_len`` above the model's position limit, a bad
            ``--generation-config`` / ``--chat-template`` / ``--max-logprobs`` /
            ``--runner`` / ``--convert`` / ``--pooler-config``.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False
    attention_backend: str | None = None
    cpu_bf16_linear: str = "auto"
    cpu_bf16_attention: str = "auto"
    cpu_f32_linear: str = "auto"
    cpu_linear_kernel: str = "auto"
    cpu_brgemm_linear: str = "auto"
    served_model_name: str | None = None
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config_source: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    chat_template: str | None = field(default=None, repr=False)
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: PoolerConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    generation_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        path = Path(self.model).expanduser()
        if not path.is_dir():
            raise ConfigError("--model", self.model, "must be a local Hugging Face model directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError("--model", self.model, "the directory has no config.json")
        given = self.model
        self.model = str(path.resolve())
        self._tokenizer_given = self.tokenizer is not None
        if self.tokenizer is None:
            self.tokenizer = self.model
        elif not Path(self.tokenizer).expanduser().is_dir():
            raise ConfigError("--tokenizer", self.tokenizer, "must be a local tokenizer directory")
        try:
            self.hf_config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("--model", self.model, f"config.json is unreadable: {e}") from None
        self._load_generation_config(path)
        archs = self.hf_config.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ConfigError(
                "--model",
                self.model,
                f"architecture {archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", self.dtype, f"allowed: {', '.join(DTYPES)}")
        self._resolve_runner()
        # None: the worker chooses, knowing its device (CPU_PAGED_CPP on a CPU where the
        # kernel builds, else TORCH_SDPA; ModelRunner._choose_attention_backend).
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                "--attention-backend", self.attention_backend, f"allowed: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.attention_backend == "PAGED_INDUCTOR" and self.enforce_eager:
            raise ConfigError(
                "--attention-backend",
                self.attention_backend,
                "its decode kernel is compiled by torch.compile, which --enforce-eager rules out; "
                "use TORCH_SDPA with --enforce-eager",
            )
        for flag, value in (("--cpu-bf16-linear", self.cpu_bf16_linear),
                            ("--cpu-bf16-attention", self.cpu_bf16_attention)):  # fmt: skip
            if value not in CPU_BF16_MODES:
                raise ConfigError(flag, value, f"allowed: {', '.join(CPU_BF16_MODES)}")
        if self.cpu_f32_linear not in CPU_F32_LINEAR_MODES:
            raise ConfigError("--cpu-f32-linear", self.cpu_f32_linear,
                              f"allowed: {', '.join(CPU_F32_LINEAR_MODES)}")  # fmt: skip
        if self.cpu_linear_kernel not in CPU_LINEAR_KERNEL_MODES:
            raise ConfigError("--cpu-linear-kernel", self.cpu_linear_kernel,
                              f"allowed: {', '.join(CPU_LINEAR_KERNEL_MODES)}")  # fmt: skip
        if self.cpu_brgemm_linear not in CPU_BRGEMM_LINEAR_MODES:
            raise ConfigError("--cpu-brgemm-linear", self.cpu_brgemm_linear,
                              f"allowed: {', '.join(CPU_BRGEMM_LINEAR_MODES)}")  # fmt: skip
        if not isinstance(self.seed, int):
            raise ConfigError("--seed", self.seed, "must be an integer")
        limit = self.max_position_embeddings
        check_positive_int("--max-model-len", self.max_model_len)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError(
                "--max-model-len",
                self.max_model_len,
                f"must be at most the model's max_position_embeddings={limit}",
            )
        if self.served_model_name is None:
            # vLLM serves a model under the name it was given; the bundled ones have short names.
            bundled = {str(Path(DEFAULT_MODEL).resolve()): DEFAULT_SERVED_NAME,
                       str(Path(MOE_MODEL).resolve()): MOE_SERVED_NAME}  # fmt: skip
            self.served_model_name = bundled.get(self.model, given)
        if not isinstance(self.served_model_name, str) or not self.served_model_name.strip():
            raise ConfigError("--served-model-name", self.served_model_name, "must be a non-empty name")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ConfigError(
                "--tokenizer-mode",
                self.tokenizer_mode,
                "Glassbox does not support it: it loads fast tokenizers (tokenizer.json) only; allowed: auto, hf",
            )
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ConfigError(
                "--max-logprobs", self.max_logprobs, "must be an integer >= 0, or -1 for no cap"
            )
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)
        if self.trust_remote_code:
            archs = "/".join(a.removesuffix("ForCausalLM") for a in SUPPORTED_ARCHITECTURES)
            self._log_once(
                "--trust-remote-code is accepted for vLLM compatibility and changes nothing: Glassbox "
                f"never runs code from a model directory (only its own {archs} code)"
            )

    def _resolve_runner(self) -> None:
        """``runner_type`` and ``convert_type`` from ``--runner`` / ``--convert`` (vLLM's
        ``_get_runner_type`` / ``_get_convert_type``), and the pooling model's pooler config."""
        if self.runner not in RUNNER_OPTIONS:
            why = " (draft models for speculative decoding are left out)" if self.runner == "draft" else ""
            raise ConfigError("--runner", self.runner, f"allowed: {', '.join(RUNNER_OPTIONS)}{why}")
        if self.convert not in CONVERT_OPTIONS:
            why = " (classification models are left out)" if self.convert == "classify" else ""
            raise ConfigError("--convert", self.convert, f"allowed: {', '.join(CONVERT_OPTIONS)}{why}")
        if self.runner != "auto":
            self.runner_type = self.runner
        else:  # every architecture here generates text; a conversion asks for pooling
            self.runner_type = "pooling" if self.convert == "embed" else "generate"
        if self.runner_type == "generate" and self.convert == "embed":
            raise ConfigError("--convert", self.convert, "embed converts the model for --runner pooling, "
                              "not --runner generate")  # fmt: skip
        if self.runner_type == "pooling" and self.convert == "none":
            raise ConfigError("--convert", self.convert, f"{self.architecture} is not a pooling model: "
                              "--runner pooling needs --convert embed (or auto)")  # fmt: skip
        self.convert_type = "embed" if self.runner_type == "pooling" else "none"
        if self.runner_type != "pooling":
            if self.pooler_config is not None:
                raise ConfigError("--pooler-config", self.pooler_config, "applies to --runner pooling only")
            return
        if self.pooler_config is None:
            self.pooler_config = PoolerConfig()
        if self.pooler_config.seq_pooling_type is None:
            self.pooler_config.seq_pooling_type = "LAST"  # vLLM's default for a converted decoder
        self._log_once(
            f"--runner pooling: {self.architecture} converted to an embedding model (--convert embed), "
            f"{self.pooler_config.seq_pooling_type} pooling"
            + ("" if self.pooler_config.use_activation is False else ", normalised")
        )

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        """What this engine serves: ``("generate",)`` or ``("embed",)`` (vLLM asks the
        model runner, ``get_supported_tasks``; one runner here means one answer)."""
        return ("embed",) if self.runner_type == "pooling" else ("generate",)

    @property
    def embedding_size(self) -> int:
        """The length of a pooled vector: ``hidden_size`` (no projection layers are read)."""
        return self.hidden_size

    @property
    def is_matryoshka(self) -> bool:
        """Whether the model says its embeddings may be cut short (``matryoshka_dimensions``
        or ``is_matryoshka`` in config.json): only then may a request set ``dimensions``."""
        return bool(self.hf_config.get("matryoshka_dimensions")) or bool(self.hf_config.get("is_matryoshka"))

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The lengths config.json allows (None: any length up to ``embedding_size``)."""
        return self.hf_config.get("matryoshka_dimensions") or None

    @property
    def is_chunked_prefill_supported(self) -> bool:
        """vLLM's rule: a causal model's LAST pooling reads the last chunk's last token, but
        MEAN and CLS pooling need the whole prompt in one step."""
        return self.pooler_config is None or self.pooler_config.seq_pooling_type == "LAST"

    @property
    def is_prefix_caching_supported(self) -> bool:
        """vLLM's rule, as for chunked prefill: a prefix-cache hit leaves the cached tokens'
        hidden states uncomputed, which MEAN and CLS pooling need."""
        return self.is_chunked_prefill_supported

    def check_tokenizer_files(self) -> None:
        """The frontend loads ``tokenizer.json`` (fast tokenizers only): refuse a directory
        without one before anything is spawned. (``ModelConfig`` alone does not require it:
        model-only uses — a worker, a test — need no tokenizer.)"""
        if not (Path(self.tokenizer).expanduser() / "tokenizer.json").is_file():
            if getattr(self, "_tokenizer_given", False):
                raise ConfigError(
                    "--tokenizer",
                    self.tokenizer,
                    "the directory has no tokenizer.json; only fast tokenizers are supported",
                )
            raise ConfigError(
                "--model", self.model, "the directory has no tokenizer.json (give one with --tokenizer)"
            )

    def _load_generation_config(self, model_dir: Path) -> None:
        """Read the ``generation_config.json`` in effect and check its sampling defaults."""
        source = self.generation_config_source
        flag = "--generation-config"
        if not isinstance(source, str):
            raise ConfigError(
                flag, source, "allowed: auto, vllm, or a directory holding generation_config.json"
            )
        if source in ("auto", "vllm"):
            directory, flag = model_dir, "--model"
        else:
            directory = Path(source).expanduser()
            if not directory.is_dir():
                raise ConfigError(
                    flag, source, "allowed: auto, vllm, or a directory holding generation_config.json"
                )
            if not (directory / "generation_config.json").is_file():
                raise ConfigError(flag, source, "the directory has no generation_config.json")
        gen_file = directory / "generation_config.json"
        if gen_file.is_file():
            try:
                loaded = json.loads(gen_file.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(flag, str(directory), f"bad generation_config.json: {e}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(flag, str(directory), "generation_config.json must hold a JSON object")
            self.generation_config = loaded
        override = self.override_generation_config
        if override is not None and not isinstance(override, dict):
            raise ConfigError("--override-generation-config", override, "must be a JSON object")
        unknown = sorted(set(override or {}) - set(GENERATION_CONFIG_SAMPLING_KEYS))
        if unknown:
            # A typo ("temprature") would otherwise change nothing, silently.
            raise ConfigError(
                "--override-generation-config",
                override,
                f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(GENERATION_CONFIG_SAMPLING_KEYS)}",
            )
        # A bad default would fail every request that relies on it: fail here instead.
        from engine.sampling_params import SamplingParams

        try:
            SamplingParams(**self._sampling_defaults())
        except (TypeError, ValueError) as e:
            if override and any(k in override for k in GENERATION_CONFIG_SAMPLING_KEYS):
                flag, where = "--override-generation-config", override
            else:
                where = str(gen_file)
            raise ConfigError(flag, where, f"bad sampling default: {e}") from None

    def _sampling_defaults(self) -> dict[str, Any]:
        config = {} if self.generation_config_source == "vllm" else dict(self.generation_config)
        config.update(self.override_generation_config or {})
        diff = {k: config[k] for k in GENERATION_CONFIG_SAMPLING_KEYS if config.get(k) is not None}
        if "max_new_tokens" in diff:  # Hugging Face's name for max_tokens
            diff["max_tokens"] = diff.pop("max_new_tokens")
        return diff

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The ``SamplingParams`` defaults the model sets: ``{field: value}``, maybe empty.

        vLLM's ``ModelConfig.get_diff_sampling_param``: with ``--generation-config auto`` (or a
        directory) the sampling fields of ``generation_config.json`` (temperature, top_p,
        top_k, min_p, the three penalties; ``max_new_tokens`` becomes ``max_tokens``), then
        ``--override-generation-config`` on top; with ``vllm`` only the override. Anything
        else in the file — ``do_sample`` included — is ignored, as vLLM does. A request's own
        values always win. The first call logs the defaults taken (once per process).
        """
        diff = self._sampling_defaults()
        if not diff:
            if self.generation_config_source != "vllm" and self.generation_config.get("do_sample") is False:
                self._log_once(
                    "generation_config.json says do_sample: false, which vLLM (and so Glassbox) ignores: "
                    "requests sample at temperature 1.0 unless they set a temperature (0 = greedy)"
                )
            return diff
        override = self.override_generation_config or {}
        from_override = {
            k: v
            for k, v in diff.items()
            if k in override or (k == "max_tokens" and "max_new_tokens" in override)
        }
        from_file = {k: v for k, v in diff.items() if k not in from_override}
        parts = []
        if from_file:
            where = "the model's" if self.generation_config_source == "auto" else "--generation-config's"
            parts.append(
                f"{where} generation_config.json: " + ", ".join(f"{k}={v}" for k, v in from_file.items())
            )
        if from_override:
            parts.append(
                "--override-generation-config: " + ", ".join(f"{k}={v}" for k, v in from_override.items())
            )
        message = (
            "Default sampling params taken from " + "; and from ".join(parts) + ". A request's own values win"
        )
        if "max_tokens" in diff:
            message += f", except that the API server caps a request's max_tokens at {diff['max_tokens']} (as vLLM does)"
        if from_file:
            message += ". To keep vLLM's defaults instead, start with --generation-config vllm"
        self._log_once(message)
        return diff

    @staticmethod
    def _log_once(message: str) -> None:
        if message not in _LOGGED_NOTES:  # once per process, however many configs and callers
            _LOGGED_NOTES.add(message)
            logger.info(message)

    @property
    def architecture(self) -> str:
        return next(a for a in self.hf_config["architectures"] if a in SUPPORTED_ARCHITECTURES)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (Mixtral's ``num_local_experts``, Qwen's
        ``num_experts``); 0 for a dense model."""
        return int(self.hf_config.get("num_local_experts") or self.hf_config.get("num_experts") or 0)

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        """One expert's intermediate width (Qwen's ``moe_intermediate_size``, Mixtral's
        ``intermediate_size``); 0 for a dense model."""
        if not self.is_moe:
            return 0
        return int(self.hf_config.get("moe_intermediate_size") or self.hf_config["intermediate_size"])

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_key_value_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id: config.json's, else the first of generation_config's."""
        for source in (self.hf_config, self.generation_config):
            eos = source.get("eos_token_id")
            if isinstance(eos, int):
                return eos
            if isinstance(eos, list) and eos:
                return int(eos[0])
        return None

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the weights were saved in (``torch_dtype`` / ``dtype`` in config.json)."""
        return str(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32")

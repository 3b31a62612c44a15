"""``EngineConfig`` and its sub-configs.

Mirrors vLLM's ``vllm/config/`` (``VllmConfig`` → our ``EngineConfig``). Each sub-config
validates its own fields in ``__post_init__`` and raises ``ConfigError`` naming the CLI flag,
the value and what is allowed, so the CLI can print one line and exit 2. Nothing here
imports torch: ``dtype="auto"`` and ``device="auto"`` are resolved by the worker and
reported back; the model's ``config.json`` is read as plain JSON.

Left out: LoRA, speculative decoding, quantization, multimodal, KV transfer.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.logger import init_logger

logger = init_logger(__name__)

# The default model ships with the package (made by scripts/make_default_model.py).
DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "default_model")
DEFAULT_SERVED_NAME = "glassbox-tiny-llama"

# Architectures the model code implements (config.json "architectures").
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --attention-backend (engine/model/attention.py): the gather + SDPA reference, or decodes
# reading the paged cache in place through a kernel compiled by Inductor, or through a
# hand-written C++ kernel for CPUs (engine/model/cpu/csrc/paged_attention_cpu.cpp).
ATTENTION_BACKENDS = ("TORCH_SDPA", "PAGED_INDUCTOR", "CPU_PAGED_CPP")
DEVICES = ("auto", "cpu", "cuda")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# What `--distributed-executor-backend ray` needs and is not installed by default.
# Glassbox is not on PyPI: the extra is installed from the checkout.
RAY_INSTALL_HINT = 'pip install -e ".[ray]" in the Glassbox checkout'
TOKENIZER_MODES = ("auto", "hf")  # both load the fast tokenizer (tokenizer.json); the only kind here
KV_CACHE_DTYPES = ("auto",)  # the KV cache is kept in the model's dtype; fp8 caches are left out
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


class ConfigError(ValueError):
    """A configuration value is not allowed.

    ``str(err)`` is one line: ``--flag: invalid value V (allowed: ...)``.
    """

    def __init__(self, flag: str, value: Any, allowed: str) -> None:
        self.flag = flag
        self.value = value
        self.allowed = allowed
        super().__init__(f"{flag}: invalid value {value!r} ({allowed})")

    @classmethod
    def from_message(cls, message: str, flag: str = "") -> ConfigError:
        """Rebuild an error from its one-line message, e.g. after it crossed a process
        boundary (a child found the bad setting during start-up)."""
        err = cls.__new__(cls)
        err.flag, err.value, err.allowed = flag, None, ""
        ValueError.__init__(err, message)
        return err


def ray_is_installed() -> bool:
    """Whether ``import ray`` would find Ray (without importing it: this runs in the first
    process, which never needs Ray itself). A ``None`` in ``sys.modules`` counts as absent,
    as it makes ``import ray`` fail."""
    import importlib.util
    import sys

    if "ray" in sys.modules:
        return sys.modules["ray"] is not None
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``RAY_ADDRESS`` (``HOST:PORT``, optionally ``ray://``) where nothing listens.

    ``ray.init`` would retry it for minutes, printing its own errors, while the engine waits;
    here one TCP connection with a ``timeout_s`` deadline answers first. ``auto``, ``local``
    and an empty value are left to Ray.

    Raises:
        ConfigError: nothing accepts a connection at the address (named with the reason).
    """
    import socket

    target = address.strip().removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local", "" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            "RAY_ADDRESS",
            address,
            f"no Ray cluster answers there ({e.strerror or e}): start one with `ray start --head` "
            "or unset RAY_ADDRESS to let Glassbox start its own",
        ) from None


def too_few_blocks_reason(max_model_len: int, needed: int) -> str:
    """Why ``--num-gpu-blocks-override`` cannot hold one request of ``max_model_len``."""
    return f"too small: one request of --max-model-len {max_model_len} needs {needed} blocks, null block included"


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


# vLLM's default --data-parallel-rpc-port.
DEFAULT_DP_RPC_PORT = 29550


def _positive_int(flag: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(flag, value, "must be a positive integer")


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

    Raises:
        ConfigError: missing directory or ``config.json``, unsupported architecture,
            bad dtype, ``max_model_len`` above the model's position limit, a bad
            ``--generation-config`` / ``--chat-template`` / ``--max-logprobs``.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False
    attention_backend: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config_source: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    chat_template: str | None = field(default=None, repr=False)
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
        if not isinstance(self.seed, int):
            raise ConfigError("--seed", self.seed, "must be an integer")
        limit = self.max_position_embeddings
        _positive_int("--max-model-len", self.max_model_len)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError(
                "--max-model-len",
                self.max_model_len,
                f"must be at most the model's max_position_embeddings={limit}",
            )
        if self.served_model_name is None:
            # vLLM serves a model under the name it was given; the bundled one has a short name.
            bundled = self.model == str(Path(DEFAULT_MODEL).resolve())
            self.served_model_name = DEFAULT_SERVED_NAME if bundled else given
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


@dataclass
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` is filled in after the worker profiled memory (including block 0,
    the null block). On CPU the budget is ``GLASSBOX_CPU_KVCACHE_SPACE`` GiB unless
    ``kv_cache_memory_bytes`` is set; on CUDA it is ``gpu_memory_utilization`` of the
    device minus weights and activations.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                "--kv-cache-dtype",
                self.cache_dtype,
                "Glassbox does not support it: only auto, the model's dtype (fp8 KV caches are left out)",
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("--block-size", self.block_size, f"allowed: {', '.join(map(str, BLOCK_SIZES))}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ConfigError("--gpu-memory-utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        _positive_int("--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 2
        ):
            raise ConfigError(
                "--num-gpu-blocks-override",
                self.num_gpu_blocks_override,
                "must be at least 2 (block 0 is the null block)",
            )


@dataclass
class ParallelConfig:
    """How the model is split across workers (``world_size = tp × pp``) and engines (dp).

    ``distributed_executor_backend``: "mp" runs each worker in its own process (the default,
    so the whole tree can be watched — vLLM defaults to "uni" at world size 1); "uni" keeps
    the single worker inside the engine core; "ray" runs each worker as a Ray actor
    (``engine/executor/ray_executor.py``; needs the ``ray`` extra, checked here). With ``GLASSBOX_ENABLE_MULTIPROCESSING=0`` the
    default is "uni": everything in the caller's process — except with tensor parallelism,
    which always needs one process per worker ("mp"; the engine core then stays in the
    caller's process, as vLLM does), and refuses an explicit "uni".
    Tensor, pipeline and data parallelism are supported (TP and PP need "mp" or "ray"; DP needs the
    engine cores in processes of their own, so not ``GLASSBOX_ENABLE_MULTIPROCESSING=0``).
    ``data_parallel_rank`` is not a flag: each ``EngineCore_DP<k>`` sets it to ``k`` in its own
    copy of the config, so its executor knows which workers (and queues) are its own. Multi-node
    data parallelism (``--headless``, ``--data-parallel-size-local``, ``--data-parallel-start-rank``,
    ``--data-parallel-address``, ``--data-parallel-rpc-port``; vLLM's fields of the same names, with
    ``data_parallel_master_ip`` spelled ``data_parallel_address``) is checked by ``_check_multi_node``. Whether ``tensor_parallel_size`` fits the model's heads, and
    ``pipeline_parallel_size`` its layers (and ``GLASSBOX_PP_LAYER_PARTITION``), is checked by
    ``EngineConfig``, which knows the model.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_rank: int = 0
    # Multi-node data parallelism (docs/multi-node.md): the engine cores of this node are
    # ranks start_rank .. start_rank + size_local - 1 of data_parallel_size; the others join
    # (or are joined) over TCP at data_parallel_address:data_parallel_rpc_port.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_DP_RPC_PORT
    headless: bool = False

    def __post_init__(self) -> None:
        _positive_int("--tensor-parallel-size", self.tensor_parallel_size, allow_none=False)
        _positive_int("--pipeline-parallel-size", self.pipeline_parallel_size, allow_none=False)
        _positive_int("--data-parallel-size", self.data_parallel_size, allow_none=False)
        self._check_multi_node()
        if self.distributed_executor_backend is None:
            from engine import envs

            multiprocess = envs.GLASSBOX_ENABLE_MULTIPROCESSING or self.world_size > 1
            self.distributed_executor_backend = "mp" if multiprocess else "uni"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                "--distributed-executor-backend",
                self.distributed_executor_backend,
                f"allowed: {', '.join(EXECUTOR_BACKENDS)}",
            )
        if self.distributed_executor_backend == "ray" and not ray_is_installed():
            raise ConfigError(
                "--distributed-executor-backend",
                "ray",
                f"runs each worker as a Ray actor, and Ray is not installed: {RAY_INSTALL_HINT}",
            )
        if self.distributed_executor_backend == "ray":
            check_ray_address(os.environ.get("RAY_ADDRESS", ""))
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            sizes = [
                f"{flag} {value}"
                for flag, value in (
                    ("--tensor-parallel-size", self.tensor_parallel_size),
                    ("--pipeline-parallel-size", self.pipeline_parallel_size),
                )
                if value > 1
            ]
            raise ConfigError(
                "--distributed-executor-backend",
                "uni",
                f"runs one worker inside the engine core; {' × '.join(sizes)} needs one process "
                "per worker: use mp",
            )
        if self.data_parallel_size > 1:
            from engine import envs

            if not envs.GLASSBOX_ENABLE_MULTIPROCESSING:
                raise ConfigError(
                    "--data-parallel-size",
                    self.data_parallel_size,
                    "runs one engine core process per rank: it needs GLASSBOX_ENABLE_MULTIPROCESSING=1",
                )

    def _check_multi_node(self) -> None:
        """Multi-node data parallelism's flags (vLLM's meaning; each error names its flag).

        Raises:
            ConfigError: a local size outside 1..D, a start rank with no room for the local
                ranks, a head (start rank 0) that runs every rank yet names nothing remote, a
                node with remote ranks but no ``--data-parallel-address``, a headless node
                that would run rank 0 (the head's), or a port outside 1..65535.
        """
        dp = self.data_parallel_size
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = dp if not self.headless else dp - self.data_parallel_start_rank
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if not isinstance(local, int) or isinstance(local, bool) or not 1 <= local <= dp:
            raise ConfigError("--data-parallel-size-local", local,
                              f"engine cores on this node: an integer in 1..--data-parallel-size ({dp})")  # fmt: skip
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or start + local > dp:
            raise ConfigError("--data-parallel-start-rank", start,
                              f"this node runs ranks start .. start + --data-parallel-size-local ({local}) - 1, "
                              f"all below --data-parallel-size ({dp}): at most {dp - local}")  # fmt: skip
        port = self.data_parallel_rpc_port
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535 - 16:
            raise ConfigError(
                "--data-parallel-rpc-port", port, "a TCP port in 1..65519 (it and the next few are used)"
            )
        if self.headless:
            if self.data_parallel_address is None:
                raise ConfigError("--data-parallel-address", None,
                                  "--headless needs the head node's address (the host that runs the API "
                                  "server), e.g. --data-parallel-address 10.0.0.1")  # fmt: skip
            if start == 0:
                raise ConfigError("--data-parallel-start-rank", start,
                                  "a --headless node runs ranks the head does not: 1 or more (the head "
                                  "runs ranks 0 .. its --data-parallel-size-local - 1)")  # fmt: skip
        else:
            if start != 0:
                raise ConfigError("--data-parallel-start-rank", start,
                                  "only a --headless node starts above rank 0 (the head runs ranks from 0)")  # fmt: skip
            if local < dp and self.data_parallel_address is None:
                raise ConfigError("--data-parallel-address", None,
                                  f"ranks {local}..{dp - 1} run on headless nodes, which join this head over "
                                  "TCP: give the address they reach it at, e.g. --data-parallel-address 10.0.0.1")  # fmt: skip

    @property
    def multi_node(self) -> bool:
        """Some engine cores of the instance run on another node (head or headless): the
        engine sockets are TCP on ``data_parallel_address``, not ipc."""
        return (
            self.headless
            or (self.data_parallel_size_local or self.data_parallel_size) < self.data_parallel_size
        )

    @property
    def local_dp_ranks(self) -> range:
        """The DP ranks whose engine cores run on this node."""
        start = self.data_parallel_start_rank
        return range(start, start + (self.data_parallel_size_local or self.data_parallel_size))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
        _positive_int("--max-num-batched-tokens", self.max_num_batched_tokens, allow_none=False)
        _positive_int("--max-num-seqs", self.max_num_seqs, allow_none=False)
        _positive_int("--max-model-len", self.max_model_len, allow_none=False)
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


@dataclass
class DeviceConfig:
    """Where the worker runs: "auto" picks CUDA when present, else CPU (resolved by the worker)."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("--device", self.device, f"allowed: {', '.join(DEVICES)}")


@dataclass
class LoadConfig:
    """How weights are read. Only local safetensors in Hugging Face layout."""

    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors"):
            raise ConfigError("--load-format", self.load_format, "allowed: auto, safetensors")


@dataclass
class ObservabilityConfig:
    """Tracing and request logging.

    ``trace_file``: every finished span as one JSON line (Glassbox addition).
    ``enable_log_requests``: the API server logs one line per request (id, prompt, params),
    with prompts cut to ``max_log_len`` characters / token ids (None: whole). vLLM keeps
    these two among its frontend arguments; here they travel in the config so the API
    server's ``AsyncLLM`` sees them.
    ``telemetry_record``: write every process's live telemetry to this file (engine-top
    ``--replay`` plays it). ``step_delay_ms``: sleep this long after each engine step, so a
    class can watch the scheduler in slow motion (both Glassbox additions).
    ``inject_fault``: the fault spec (``--inject-fault``, else ``GLASSBOX_FAULT``) the first
    process puts in ``GLASSBOX_FAULT`` for every child (``tracing.faults``, ``docs/faults.md``).
    """

    otlp_traces_endpoint: str | None = None
    trace_file: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    telemetry_record: str | None = None
    step_delay_ms: float = 0.0
    collect_detailed_traces: str | None = None
    inject_fault: str | None = None

    DETAILED_TRACE_LEVELS = ("model", "worker", "all")

    @property
    def collect_model_forward_time(self) -> bool:
        """``model`` (or worker/all): the workers' forward and sampling spans (vLLM's property)."""
        return self.collect_detailed_traces is not None

    @property
    def collect_worker_traces(self) -> bool:
        """``worker`` or ``all``: each worker's ``worker.execute_model`` span per step."""
        return bool(self.collect_detailed_traces) and bool(
            {"worker", "all"} & set(self.collect_detailed_traces.split(","))
        )

    def __post_init__(self) -> None:
        if (
            not isinstance(self.step_delay_ms, (int, float))
            or isinstance(self.step_delay_ms, bool)
            or not 0 <= self.step_delay_ms <= 60_000
        ):
            raise ConfigError(
                "--step-delay-ms", self.step_delay_ms, "must be a number of milliseconds in 0..60000"
            )
        if self.inject_fault is not None:
            from tracing.faults import parse_faults

            try:
                faults = parse_faults(self.inject_fault)
            except ValueError as e:
                raise ConfigError("--inject-fault", self.inject_fault, str(e)) from None
            self.inject_fault = ",".join(str(f) for f in faults) or None
        if self.collect_detailed_traces is not None:
            levels = [x.strip() for x in str(self.collect_detailed_traces).split(",")]
            if not levels or any(x not in self.DETAILED_TRACE_LEVELS for x in levels):
                raise ConfigError("--collect-detailed-traces", self.collect_detailed_traces,
                                  f"must be one or more of {', '.join(self.DETAILED_TRACE_LEVELS)}, comma-separated")  # fmt: skip
            self.collect_detailed_traces = ",".join(levels)
        if self.telemetry_record is not None:
            parent = os.path.dirname(os.path.abspath(self.telemetry_record))
            if os.path.isdir(self.telemetry_record) or not os.access(parent, os.W_OK):
                raise ConfigError("--telemetry-record", self.telemetry_record,
                                  "must be a file path in a writable directory")  # fmt: skip
        if self.max_log_len is not None and (
            not isinstance(self.max_log_len, int)
            or isinstance(self.max_log_len, bool)
            or self.max_log_len < 0
        ):
            raise ConfigError("--max-log-len", self.max_log_len, "must be an integer >= 0")
        self._check_otlp()

    def _check_otlp(self) -> None:
        """OTLP settings (the flag, ``OTEL_EXPORTER_OTLP_*``, ``OTEL_TRACES_SAMPLER``) are
        checked here, in the first process, so a bad one is one line and exit 2 instead of a
        warning in every process (``tracing.setup.resolve_otlp``; docs/otlp.md)."""
        if self.otlp_traces_endpoint is not None and not isinstance(self.otlp_traces_endpoint, str):
            raise ConfigError("--otlp-traces-endpoint", self.otlp_traces_endpoint, "must be a URL")
        from tracing.setup import OtlpSettingError, check_traces_sampler, resolve_otlp

        try:
            target = resolve_otlp(self.otlp_traces_endpoint)
            if target is not None or self.trace_file:
                check_traces_sampler()
        except OtlpSettingError as e:
            raise ConfigError(e.setting, e.value, e.allowed) from None


@dataclass
class EngineConfig:
    """The whole configuration, passed whole to every process (vLLM: ``VllmConfig``)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig | None = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        max_len = self.model_config.max_model_len
        if self.scheduler_config is None:
            self.scheduler_config = SchedulerConfig(max_model_len=max_len)
        else:
            self.scheduler_config.max_model_len = max_len
            self.scheduler_config.__post_init__()
        # Checked here, in the first process, so it fails before anything is spawned (the
        # engine core checks it again where the cache is sized).
        override = self.cache_config.num_gpu_blocks_override
        if override is not None and max_len is not None:
            needed = -(-max_len // self.cache_config.block_size) + 1
            if override < needed:
                raise ConfigError(
                    "--num-gpu-blocks-override", override, too_few_blocks_reason(max_len, needed)
                )
        self._check_tensor_parallel_size()
        self._check_pipeline_parallel_size()
        if self.model_config.attention_backend == "CPU_PAGED_CPP" and self.device_config.device == "cuda":
            # With --device auto the device is known only in the worker: set_attention_backend
            # refuses it there.
            raise ConfigError(
                "--attention-backend",
                "CPU_PAGED_CPP",
                "its kernel runs on the CPU only, and --device is cuda; use TORCH_SDPA or PAGED_INDUCTOR",
            )
        if not any(Path(self.model_config.model).glob("*.safetensors")):
            # Found here, not by the worker after the whole tree has started.
            raise ConfigError(
                "--model", self.model_config.model, "the directory has no *.safetensors weights"
            )
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def _check_tensor_parallel_size(self) -> None:
        """Refuse, in the first process, a TP size that does not split the model evenly.

        Query heads and MLP columns must divide by TP. KV heads must too — or, when TP is
        larger, TP must be a multiple of them: each KV head is then replicated on
        ``tp / num_kv_heads`` ranks (vLLM's rule).
        """
        tp = self.parallel_config.tensor_parallel_size
        if tp == 1:
            return
        model = self.model_config
        heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
        if heads % tp:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide the number of attention heads ({heads}) of {model.model}",
            )
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide the number of KV heads ({kv_heads}) of {model.model}, "
                "or be a multiple of it (each KV head then replicated)",
            )
        intermediate = int(model.hf_config.get("intermediate_size") or 0)
        if intermediate % tp:
            raise ConfigError(
                "--tensor-parallel-size",
                tp,
                f"must divide intermediate_size ({intermediate}) of {model.model}",
            )

    def _check_pipeline_parallel_size(self) -> None:
        """Refuse, in the first process, a PP size or layer partition that does not fit the model.

        Every stage needs at least one decoder layer; ``GLASSBOX_PP_LAYER_PARTITION``, when
        set, must give one count per stage summing to ``num_hidden_layers``.
        """
        from engine.distributed.utils import PARTITION_ENV, get_pp_partition

        pp = self.parallel_config.pipeline_parallel_size
        layers = self.model_config.num_hidden_layers
        try:
            get_pp_partition(layers, pp)
        except ValueError as e:
            if os.environ.get(PARTITION_ENV):
                reason = str(e).split(": ", 1)[-1]  # the variable and value are named already
                raise ConfigError(PARTITION_ENV, os.environ[PARTITION_ENV], reason) from None
            raise ConfigError(
                "--pipeline-parallel-size",
                pp,
                f"must not exceed num_hidden_layers ({layers}) of {self.model_config.model}",
            ) from None

    def max_layers_per_stage(self) -> int:
        """The most decoder layers any pipeline stage holds (its workers need the most KV memory)."""
        from engine.distributed.utils import get_pp_partition

        return max(
            get_pp_partition(self.model_config.num_hidden_layers, self.parallel_config.pipeline_parallel_size)
        )

"""The model runner: one step's ``SchedulerOutput`` in, sampled tokens out.

Mirrors vLLM's ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``). Each step:

1. ``_update_states``: keep the worker's mirror of every request (``CachedRequestState``)
   in line with the scheduler — new requests arrive whole, known ones as deltas (new
   block ids appended, or the whole block list replaced after a preemption);
2. ``_prepare_inputs``: flatten the batch into ``input_ids``/``positions`` and compute each
   token's KV-cache slot, ``slot = block_table[req, pos // block_size] * block_size +
   pos % block_size``. Decodes (one token) go first so attention can batch them. Arrays
   are built with numpy, per request, never per token;
3. run the model — eagerly with the metadata and caches as arguments, or compiled
   (``engine/model/cpu/compile.py``, the default unless ``--enforce-eager``) inside the
   forward context that the compiled graph's attention op reads — take the hidden state of each request's last scheduled token (only for
   requests whose prompt is complete after this step: a chunk that leaves part of the
   prompt for later samples nothing), compute logits and sample;
4. append the sampled tokens to the mirror and return ``ModelRunnerOutput``.

Pooling models (``--runner pooling``): step 3 hands the final hidden states to the model's
pooler (``engine/model/pooler.py``) instead of the LM head and the sampler: one vector per
request whose whole prompt is computed after this step (a chunk that leaves part of the
prompt for later gets None), returned as float32 bytes in ``ModelRunnerOutput.pooler_output``
(vLLM's ``_pool``). Nothing is sampled and no token is appended.

Pipeline parallelism: a stage other than the first takes the previous stage's hidden states
(``intermediate_tensors``, received by the worker) instead of looking up token ids, and a
stage other than the last returns ``IntermediateTensors`` instead of sampling. Those stages
never see a sampled token, so the scheduler sends each request's scheduled tokens along
(``CachedRequestData.new_token_ids``, filled only with PP) and they append them here.

Structured outputs: the ``SchedulerOutput`` carries the grammar bitmask the engine core's
``StructuredOutputManager`` built; ``apply_grammar_bitmask`` sets the forbidden tokens' logits
to -inf before the sampler runs.

Left out: the persistent ``InputBatch`` (we rebuild small arrays each step), CUDA graphs,
async scheduling, speculative decoding, multimodal inputs, token-wise pooling.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import envs
from engine.config import EngineConfig
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig, kv_cache_spec
from engine.model.attention import AttentionMetadata, KVCache
from engine.model.attention_selector import set_attention_backend
from engine.model.cpu.compile import (
    CompiledModel,
    missing_cxx_compiler,
    use_compile_cache_dir,
)
from engine.model.cpu.op_threads import compiled_step_threads, op_threads
from engine.model.forward_context import set_forward_context
from engine.model.loader import load_model
from engine.model.moe import FusedMoE
from engine.model.pooler import PoolingMetadata
from engine.model.sampler import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from engine.model.utils import IntermediateTensors
from engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, Float32Tensor, LogprobsLists, ModelRunnerOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from tracing import catalogue, faults, stage

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """The worker's copy of one request (vLLM: ``CachedRequestState``).

    ``num_computed_tokens`` is the scheduler's count before the current step;
    ``output_token_ids`` grows by the token sampled each step. ``generator`` exists only
    for a seeded request and is advanced by every draw, so a seed replays exactly.
    ``num_prompt_logprobs_done`` counts prompt positions whose logprobs were already
    returned (a resumed request does not report them twice). A pooling request has
    ``pooling_params`` and no ``sampling_params``.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    num_prompt_logprobs_done: int = 0
    pooling_params: PoolingParams | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` of prompt followed by outputs."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[start:end] + self.output_token_ids[max(start - n, 0) : max(end - n, 0)]


def _resume_from_preemption(
    state: CachedRequestState, new_block_ids: tuple[list[int], ...] | None, tokens: list[int] | None
) -> None:
    """A preempted request is scheduled again: preemption freed its old blocks, so the new
    list replaces them; ``tokens`` (all of its tokens, when sent) rebuild its outputs."""
    state.block_ids = list(new_block_ids[0]) if new_block_ids else []
    if tokens is not None:
        state.output_token_ids = list(tokens[state.num_prompt_tokens :])


def _append_scheduled_tokens(state: CachedRequestState, tokens: list[int]) -> None:
    """Pipeline parallelism, a stage before the last: it samples nothing, so it learns the
    last stage's tokens from the scheduler (``tokens``: those scheduled now, the newest of
    them sampled last step) and appends the ones it does not have yet."""
    num_new = state.num_computed_tokens + len(tokens) - state.num_tokens
    if num_new > 0:
        state.output_token_ids.extend(tokens[-num_new:])


@dataclass
class _Batch:
    """One step's flattened inputs (device tensors) and what to read back after the forward."""

    req_ids: list[str]
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # batch indices of requests that sample this step
    logits_indices: torch.Tensor  # (len(sample_rows),) token index of each one's last token
    prompt_logprob_rows: list[int]  # batch indices of requests that asked for prompt logprobs


def apply_grammar_bitmask(
    scheduler_output: SchedulerOutput, req_ids: list[str], logits: torch.Tensor
) -> None:
    """Structured outputs: set the logit of every token a request's grammar forbids to -inf,
    in place, before sampling (vLLM: ``GPUModelRunner.apply_grammar_bitmask``).

    ``scheduler_output.grammar_bitmask`` holds one int32 row per id of
    ``structured_output_request_ids``, ``ceil(vocab / 32)`` words, bit ``j`` of word ``w``
    allowing token ``32 * w + j``; ``req_ids[i]`` is the request of logits row ``i``. Rows of
    requests without a grammar are left alone; tokens past the bitmask's width are forbidden.
    The words are read as the host's int32 (little-endian on x86-64 and ARM64, as llguidance
    writes them in the engine core: both ends run on the same kind of host).

    Args:
        logits: ``(len(req_ids), vocab_size)`` float32, changed in place.
    """
    rows_of = {req_id: i for i, req_id in enumerate(scheduler_output.structured_output_request_ids)}
    masked = [(row, rows_of[req_id]) for row, req_id in enumerate(req_ids) if req_id in rows_of]
    if not masked:
        return
    words = np.frombuffer(scheduler_output.grammar_bitmask, dtype=np.int32).reshape(len(rows_of), -1)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # (len(ids), 32 * words) 0/1
    num_rows, vocab_size = logits.shape
    width = min(vocab_size, bits.shape[1])
    # One mask over every logits row (rows without a grammar forbid nothing), one masked_fill_.
    forbidden = np.zeros((num_rows, vocab_size), dtype=bool)  # (num_rows, vocab)
    logit_rows = [row for row, _ in masked]
    forbidden[logit_rows] = True
    forbidden[logit_rows, :width] = bits[[mask_row for _, mask_row in masked], :width] == 0
    logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))


def _is_compile_failure(error: BaseException) -> bool:
    """Whether ``error`` may come from torch.compile itself (Dynamo, Inductor, the C++
    compiler it runs, its cache directory) rather than from the model. The caller reruns the
    step eagerly, so an error of the model's own is raised again there."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return isinstance(error, (TorchDynamoException, InductorError, OSError, subprocess.SubprocessError))


def _check_inductor_can_compile(device: torch.device) -> None:
    """PAGED_INDUCTOR's kernel is compiled by Inductor: fail at once, naming the way out,
    rather than deep inside the first compile.

    Raises:
        RuntimeError: a CPU device and no C++ compiler (``$CXX``, ``g++`` or ``clang++``) on PATH.
    """
    missing = missing_cxx_compiler(device)
    if missing:
        raise RuntimeError(
            f"--attention-backend PAGED_INDUCTOR compiles its kernel with a C++ compiler, and there is "
            f"{missing}: install one (e.g. apt install g++) or use --attention-backend TORCH_SDPA"
        )


class ModelRunner:
    """Runs the model for the scheduler's batches on one device (vLLM: ``GPUModelRunner``).

    Lifecycle (called by the worker, in this order): ``load_model`` → ``get_kv_cache_spec``
    → ``profile_run`` → ``initialize_kv_cache`` → ``warm_up`` → ``execute_model`` per step.

    Args:
        config: the whole engine configuration.
        device: the resolved device (``loader.resolve_device``).
        dtype: the resolved weight/activation dtype (``loader.resolve_dtype``).
    """

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # --runner pooling: the model's pooler runs where the LM head and sampler would.
        self.is_pooling_model = config.model_config.runner_type == "pooling"
        # --collect-detailed-traces: forward and sampling spans in each step's trace.
        self.collect_model_spans = config.observability_config.collect_model_forward_time
        self.model: torch.nn.Module | None = None
        # Bytes in memory: the weights (parameters and buffers, ``model_weight_bytes``, what the
        # checkpoint holds for this rank) plus, on a CPU, their oneDNN-packed copies
        # (``model_packed_bytes``); ``model_memory_usage`` is the sum (vLLM's name).
        self.model_memory_usage = 0
        self.model_weight_bytes = 0
        self.model_packed_bytes = 0
        self.model_num_params = 0
        self.model_expert_bytes = 0  # the routed experts' share of model_weight_bytes (MoE)
        self.kv_caches: list[KVCache] = []
        # On a CPU, the pages the KV cache lies on, for the worker's runs_as ("2 MiB pages").
        self.kv_cache_pages: str | None = None
        self.compiled: CompiledModel | None = None  # set by warm_up unless the model runs eagerly
        self.attention_layers: list = []  # this stage's Attention modules, by local layer index
        self.moe_layers: dict[int, FusedMoE] = {}  # this stage's MoE layers' experts, by local layer index
        self.attention_backend = self.model_config.attention_backend  # resolved by warm_up
        from engine.distributed.parallel_state import get_pp_group

        pp = get_pp_group()  # None without pipeline parallelism: the one stage is first and last
        self.is_first_stage = pp is None or pp.is_first_rank
        self.is_last_stage = pp is None or pp.is_last_rank
        # Expert parallelism across DP engines: every step runs one forward, a dummy one when
        # nothing is scheduled, so each rank joins every MoE layer's all-to-alls once a step
        # (vLLM's engine core runs execute_dummy_batch after such a step instead).
        self.forward_every_step = config.parallel_config.expert_parallel_across_dp

    # ------------------------------------------------------------------ lifecycle

    def load_model(self) -> None:
        """Build the model on the device and load its weights; sets ``model_memory_usage`` (bytes)."""
        self.model = load_model(self.model_config, self.device, self.dtype)
        params = list(self.model.parameters())  # a tied table once (parameters() dedups)
        weights = params + list(self.model.buffers())
        # The CPU's oneDNN copies of the linear weights (engine/model/cpu/linear.py: for its
        # matmul, upcast, and for the brgemm micro-kernel) count too.
        packed = [
            t
            for m in self.model.modules()
            for name in ("packed_weight", "packed_weight_f32", "packed_weight_brgemm")
            if (t := getattr(m, name, None)) is not None
        ]
        self.model_num_params = sum(p.numel() for p in params)
        self.model_weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        self.model_packed_bytes = sum(t.numel() * t.element_size() for t in packed)
        self.model_memory_usage = self.model_weight_bytes + self.model_packed_bytes
        self.attention_layers = [layer.self_attn.attn for layer in self.model.local_layers]
        # An MoE model's routed experts, by local layer index (the compiled graph's moe op).
        self.moe_layers = {m.layer_index: m for m in self.model.modules() if isinstance(m, FusedMoE)}
        self.model_expert_bytes = sum(
            p.numel() * p.element_size() for m in self.moe_layers.values() for p in m.parameters()
        )
        logger.debug(
            "model %s loaded on %s as %s: %.1f MiB",
            self.model_config.architecture,
            self.device,
            self.dtype,
            self.model_memory_usage / 2**20,
        )

    def describe_model_memory(self) -> str:
        """What the loaded weights take, in words (the worker's load log line): e.g. ``4.0 M
        parameters, 15.3 MiB of float32 weights + 15.3 MiB of oneDNN-packed copies = 30.5 MiB
        in memory``. The weights' bytes are the checkpoint's for a float32 one loaded as float32
        (``model.safetensors``' size, for one unsharded rank)."""
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{self.model_num_params / 1e6:.1f} M parameters, {self.model_weight_bytes / 2**20:.1f} MiB of {dtype} weights"
        if self.model_packed_bytes:
            text += (
                f" + {self.model_packed_bytes / 2**20:.1f} MiB of oneDNN-packed copies (CPU) = "
                f"{self.model_memory_usage / 2**20:.1f} MiB in memory"
            )
        if self.moe_layers:
            text += f"; the routed experts {self.model_expert_bytes / 2**20:.1f} MiB of it: {self.describe_experts()}"
        return text

    def describe_experts(self) -> str:
        """Which experts this rank holds, in words: e.g. ``experts 0-1 of 4 in each of 4 layers
        (expert parallelism: 2 ranks)``."""
        first = next(iter(self.moe_layers.values()))
        layers = f"in each of {len(self.moe_layers)} layers"
        if first.ep_size > 1:
            last = first.first_local_expert + first.num_local_experts - 1
            return (f"experts {first.first_local_expert}-{last} of {first.num_experts} {layers} "
                    f"(expert parallelism: {first.ep_size} ranks)")  # fmt: skip
        if first.moe_tp_size > 1:
            return f"a 1/{first.moe_tp_size} slice of all {first.num_experts} experts {layers} (tensor parallelism)"
        return f"all {first.num_experts} experts {layers}"

    def get_kv_cache_spec(self) -> FullAttentionSpec:
        """The page shape of one layer's KV cache (``load_model`` first)."""
        assert self.model is not None, "load_model() first"
        layers = self.model.local_layers  # this pipeline stage's
        spec = kv_cache_spec(
            self.model_config,
            block_size=self.block_size,
            tensor_parallel_size=self.config.parallel_config.tensor_parallel_size,
            num_layers=len(layers),
            dtype_size=torch.empty(0, dtype=self.dtype).element_size(),
            sliding_window=self.model.sliding_window,
        )
        attn = layers[0].self_attn.attn  # the shape the cache tensors are built for
        assert (spec.num_kv_heads, spec.head_size) == (attn.num_kv_heads, attn.head_dim), (spec, attn)
        return spec

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over ``max_num_batched_tokens`` dummy tokens with no KV cache, plus a sampler run.

        The worker measures the peak memory of this call to size the KV cache. The tokens
        are split into sequences of at most ``max_model_len``, each attending causally to
        itself.
        """
        total = self.max_num_tokens
        seq_lens = [self.max_model_len] * (total // self.max_model_len)
        if total % self.max_model_len:
            seq_lens.append(total % self.max_model_len)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(self.device)
        input_ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata.for_profile(seq_lens, self.device)
        hidden = self.model(input_ids, positions, meta, None, self._dummy_intermediate(total))
        if self.is_last_stage and self.is_pooling_model:
            self._dummy_pool(hidden, seq_lens)
        elif self.is_last_stage:  # (total, hidden)
            num_rows = min(self.max_num_reqs, total)
            self._dummy_sample(self.model.compute_logits(hidden[-num_rows:]))
        self._synchronize()

    def _dummy_intermediate(self, num_tokens: int) -> IntermediateTensors | None:
        """Zeros in place of the previous stage's output, for profile and warm-up runs (which
        stages run on their own, without talking to each other); None on the first stage."""
        if self.is_first_stage:
            return None
        hidden = torch.zeros(num_tokens, self.model.model.hidden_size, dtype=self.dtype, device=self.device)
        return IntermediateTensors({"hidden_states": hidden})

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate each layer's K and V caches, ``(num_blocks, block_size, num_kv_heads, head_dim)``.

        Zero-filled: a padded position is masked out of attention, but its value still meets
        a zero weight in the matmul, and uninitialised memory could hold NaN (NaN × 0 = NaN).
        """
        spec = kv_cache_config.spec
        if spec.block_size != self.block_size:
            raise ValueError(
                f"KV cache block size {spec.block_size} differs from the runner's {self.block_size}"
            )
        shape = (kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        if self.device.type == "cpu":
            # One buffer on 2 MiB pages where Linux allows (engine/model/cpu/huge_pages.py):
            # decode attention's scattered page reads then miss the TLB far less.
            from engine.model.cpu.huge_pages import allocate_kv_cache

            flat, self.kv_cache_pages = allocate_kv_cache(
                2 * spec.num_layers, shape, self.dtype, envs.GLASSBOX_CPU_KV_HUGE_PAGES
            )
            self.kv_caches = [(flat[2 * i], flat[2 * i + 1]) for i in range(spec.num_layers)]
        else:
            self.kv_caches = [
                (
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                )
                for _ in range(spec.num_layers)
            ]
        logger.debug(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            kv_cache_config.num_blocks,
            spec.block_size,
            kv_cache_config.num_blocks * spec.bytes_per_block / 2**20,
        )

    @torch.inference_mode()
    def warm_up(self) -> dict[str, object]:
        """A few dummy steps (a prefill, a batch of decodes, the sampler) before real traffic.

        Unless ``enforce_eager`` (or ``GLASSBOX_TORCH_COMPILE=0``), the forward is compiled
        first (``engine/model/cpu/compile.py``): the first dummy step traces and compiles the one
        graph (or loads it from the compile cache). Returns what the worker's stage reports:
        ``{"mode": "inductor" | "eager", "graphs": n, "cache": "hit" | "miss" | "mixed" | "off",
        "seconds": compile seconds}``.
        Dummy tokens write only to block 0, the null block, which no request reads.
        """
        backend = self.attention_backend = self._choose_attention_backend()
        if backend == "PAGED_INDUCTOR":
            _check_inductor_can_compile(self.device)
            logger.info(
                "attention backend PAGED_INDUCTOR: compiling the paged decode kernel with Inductor "
                "(seconds the first time; cached under %s)",
                use_compile_cache_dir(),
            )
        elif backend == "CPU_PAGED_CPP":
            from engine.model.cpu.paged_attention_cpu import cpp_kernel_unavailable, kernel_path

            missing = cpp_kernel_unavailable()
            if missing:
                raise RuntimeError(
                    f"--attention-backend CPU_PAGED_CPP builds its C++ kernel at start-up, and there is "
                    f"{missing}: install one (e.g. apt install g++) or use --attention-backend TORCH_SDPA"
                )
            logger.info(
                "attention backend CPU_PAGED_CPP: decodes through the C++ paged kernel %s (built at the "
                "first start, a second or two; loaded from there after)",
                kernel_path(),
            )
        else:
            logger.info("attention backend %s", backend)
        set_attention_backend(self.attention_layers, backend, device=self.device)
        why_eager = self._why_eager()
        if why_eager is None:
            self.compiled = CompiledModel(self.model)
            logger.info(
                "compiling the model forward with torch.compile (Inductor; loaded instead when %s "
                "holds this graph)",
                self.compiled.cache_dir,
            )
        elif why_eager.startswith("torch.compile needs"):
            logger.warning("running the model eagerly: %s", why_eager)
        else:
            logger.info("running the model eagerly: %s", why_eager)
        try:
            self._warm_up_steps()
        except Exception as e:
            if self.compiled is None or not _is_compile_failure(e):
                raise
            # A compiler that is there but does not work, a cache directory that cannot be
            # written: serve eagerly rather than not at all, and say why.
            logger.warning("torch.compile failed, running the model eagerly (--enforce-eager skips the "
                           "attempt): %s: %s", type(e).__name__, (str(e).strip().splitlines() or [""])[0][:300])  # fmt: skip
            self.compiled = None
            self._warm_up_steps()
        if self.compiled is None:
            return {"mode": "eager", "graphs": 0, "cache": "off", "seconds": 0.0}
        compiled = self.compiled
        compiled.seal()
        came_from = {"hit": "loaded from the compile cache", "miss": "compiled and cached for the next start",
                     "mixed": "some loaded from the compile cache, some compiled"}[compiled.cache]  # fmt: skip
        logger.info(
            "torch.compile: %d graph(s) in %.1f s, %s", compiled.num_graphs, compiled.compile_s, came_from
        )
        return {"mode": "inductor", "graphs": compiled.num_graphs, "cache": compiled.cache,
                "seconds": compiled.compile_s}  # fmt: skip

    def _warm_up_steps(self) -> None:
        """A prefill and two batches of decodes on dummy tokens (block 0, the null block)."""
        prefill_len = min(self.max_num_tokens, self.max_model_len, 4 * self.block_size)
        self._dummy_step([prefill_len])
        num_decodes = min(self.max_num_reqs, self.max_num_tokens, 8)
        for _ in range(2):
            self._dummy_step([1] * num_decodes)
        self._synchronize()

    def _choose_attention_backend(self) -> str:
        """``--attention-backend`` when given; else ``CPU_PAGED_CPP`` on a CPU where its kernel
        builds (the fastest measured, docs/performance.md), ``TORCH_SDPA`` otherwise — with a
        warning saying why when the CPU kernel was wanted but could not be built."""
        requested = self.model_config.attention_backend
        if requested is not None:
            return requested
        if self.device.type != "cpu":
            return "TORCH_SDPA"
        from engine.model.cpu.paged_attention_cpu import cpp_kernel_unavailable, load_kernel

        why = cpp_kernel_unavailable()
        if why is None:
            try:
                load_kernel()
                return "CPU_PAGED_CPP"
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                why = str(e).splitlines()[0]
        logger.warning("attention backend TORCH_SDPA: the C++ paged kernel (CPU_PAGED_CPP) is not "
                       "available here (%s)", why)  # fmt: skip
        return "TORCH_SDPA"

    def _why_eager(self) -> str | None:
        """Why the forward runs eagerly (a sentence for the log), or None to compile it."""
        if self.model_config.enforce_eager:
            return "--enforce-eager"
        if envs.GLASSBOX_TORCH_COMPILE is False:
            return "GLASSBOX_TORCH_COMPILE is off"
        missing = missing_cxx_compiler(self.device)
        if missing:
            return f"torch.compile needs a C++ compiler on a CPU and there is {missing} (install one, e.g. g++, or fix $CXX)"
        return None

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors:
        """Run one scheduled step and sample.

        Returns one entry of ``sampled_token_ids`` per scheduled request, in batch order
        (decodes first); an empty list for a prefill chunk that leaves prompt tokens for
        later. ``logprobs`` and ``prompt_logprobs_dict`` hold rows for requests that asked.
        With pipeline parallelism, a stage other than the first needs the previous stage's
        ``intermediate_tensors``, and a stage other than the last returns its own instead.
        """
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self.forward_every_step:
                self._dummy_step([1])  # the other engines' MoE all-to-alls wait for this rank's
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self._prepare_inputs(scheduler_output)
        with self._detail(catalogue.MODEL_RUNNER_FORWARD, scheduler_output.total_num_scheduled_tokens):
            hidden = self._run_model(
                batch.input_ids, batch.positions, batch.attn_metadata, intermediate_tensors
            )
        if not self.is_last_stage:
            return hidden  # IntermediateTensors, for the next stage
        if self.is_pooling_model:
            with self._detail(catalogue.MODEL_RUNNER_POOL), op_threads():
                return self._pool(batch, hidden)

        with self._detail(catalogue.MODEL_RUNNER_SAMPLE), op_threads():
            sampled_lists, logprobs = self._sample(batch, hidden, scheduler_output)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(batch.req_ids)},
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs_dict=self._prompt_logprobs(batch, hidden) if batch.prompt_logprob_rows else {},
        )

    def _run_model(self, input_ids, positions, meta: AttentionMetadata, intermediate_tensors):
        """The model's forward for one step: eager (the metadata and caches are arguments), or
        compiled (they are in the forward context, where the attention op reads them)."""
        if self.compiled is None:
            with op_threads():  # the worker's thread count of the moment; no graph to guard
                return self.model(input_ids, positions, meta, self.kv_caches, intermediate_tensors)
        # Compiled: torch's count is the fused loops' (all of the step's threads, or one); the
        # opaque ops (linears, attention) set op_threads themselves.
        with (
            set_forward_context(meta, self.kv_caches, self.attention_layers, self.moe_layers),
            compiled_step_threads(has_prefill=meta.num_decodes < meta.num_reqs),  # its fused loops
        ):
            return self.compiled(input_ids, positions, intermediate_tensors)

    def _detail(self, name: str, num_tokens: int | None = None):
        """A step-level span when ``--collect-detailed-traces`` asks for the model's (or an
        injected fault targets it); else nothing."""
        if not self.collect_model_spans and name not in faults.armed_stages():
            return contextlib.nullcontext()
        return stage(name, **({catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS: num_tokens} if num_tokens else {}))

    def _sample(
        self, batch: _Batch, hidden: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Logits of the rows that sample, the grammar bitmask on them, then the sampler; each
        sampled token is appended to its request's mirror. Returns one list per batch row
        (empty: no sample this step) and the logprob rows of the requests that asked."""
        sampled_lists: list[list[int]] = [[] for _ in batch.req_ids]
        if not batch.sample_rows:
            return sampled_lists, {}
        states = [self.requests[batch.req_ids[row]] for row in batch.sample_rows]
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # (num_sample, vocab) float32
        if scheduler_output.grammar_bitmask is not None:
            apply_grammar_bitmask(scheduler_output, [s.req_id for s in states], logits)
        sampling_metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            [s.eos_token_id for s in states],
            self.vocab_size,
            self.device,
        )
        out = self.sampler(logits, sampling_metadata)
        for row, state, token in zip(batch.sample_rows, states, out.sampled_token_ids.tolist()):
            state.output_token_ids.append(token)
            sampled_lists[row] = [token]
        tensors = out.logprobs_tensors
        return sampled_lists, (self._logprobs_lists(tensors, states) if tensors is not None else {})

    def _pool(self, batch: _Batch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """The pooler over this step's hidden states ``(num_tokens, hidden)``: one float32
        vector per request whose prompt is complete after this step, None for a chunk that
        leaves part of it for later (vLLM's ``_pool``; every request of a pooling model's
        batch pools)."""
        meta = batch.attn_metadata
        states = [self.requests[req_id] for req_id in batch.req_ids]
        starts = meta.query_start_loc_cpu
        num_scheduled = [end - start for start, end in zip(starts, starts[1:])]
        metadata = PoolingMetadata(
            prompt_lens=[s.num_prompt_tokens for s in states],
            pooling_params=[s.pooling_params for s in states],
        )
        metadata.build_pooling_cursor(num_scheduled, meta.seq_lens_cpu, self.device)
        pooled = self.model.pooler(hidden[: starts[-1]], metadata)  # one (dims,) float32 per request
        finished = metadata.get_pooling_cursor().get_finished_mask()
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(batch.req_ids)},
            sampled_token_ids=[[] for _ in batch.req_ids],
            pooler_output=[
                Float32Tensor.from_numpy(vector.cpu().numpy()) if done else None
                for vector, done in zip(pooled, finished)
            ],
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's news to the request mirror (see ``engine/sched/output.py``)."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            seed = new.sampling_params.seed if new.sampling_params is not None else None
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                eos_token_id=new.eos_token_id,
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
                generator=None if seed is None else torch.Generator(self.device).manual_seed(seed),
                pooling_params=new.pooling_params,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                _resume_from_preemption(state, cached.new_block_ids[i], cached.resumed_req_token_ids[i])
                continue
            if cached.new_block_ids[i] is not None:
                state.block_ids.extend(cached.new_block_ids[i][0])
            if cached.new_token_ids and not self.is_last_stage:
                _append_scheduled_tokens(state, cached.new_token_ids[i])

    def _prepare_inputs(self, so: SchedulerOutput) -> _Batch:
        """Flatten the scheduled requests (decodes first) into token arrays and metadata."""
        scheduled = so.num_scheduled_tokens
        req_ids = sorted(scheduled, key=lambda r: scheduled[r] > 1)  # decodes (one token) first, in order
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(req_ids)

        num_scheduled = np.fromiter((scheduled[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_decodes = int(np.count_nonzero(num_scheduled == 1))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = num_computed + num_scheduled  # (num_reqs,) tokens in the cache after this step

        # Per request: its tokens of this step, its row of the block table, and whether it
        # samples (all its known tokens are in the cache after this step).
        input_ids: list[int] = []
        block_table = np.zeros((num_reqs, max(len(s.block_ids) for s in states)), dtype=np.int32)  # 0: null
        sample_rows, prompt_logprob_rows = [], []
        for i, (state, start, end) in enumerate(zip(states, num_computed.tolist(), seq_lens.tolist())):
            input_ids.extend(state.token_ids(start, end))
            block_table[i, : len(state.block_ids)] = state.block_ids
            if end >= state.num_tokens:
                sample_rows.append(i)
            if state.sampling_params is not None and state.sampling_params.prompt_logprobs is not None:
                prompt_logprob_rows.append(i)

        # Per token: which request it belongs to, its position in that request, its KV slot.
        req_index = np.repeat(np.arange(num_reqs), num_scheduled)  # (num_tokens,)
        positions = num_computed[req_index] + np.arange(num_tokens) - query_start_loc[req_index]
        bs = self.block_size
        slot_mapping = block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs

        meta = AttentionMetadata(
            num_reqs=num_reqs,
            num_decodes=num_decodes,
            slot_mapping=self._to_device(slot_mapping, torch.int64),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_table=self._to_device(block_table, torch.int32),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            num_computed_tokens_cpu=num_computed.tolist(),
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            block_size=bs,
            decode_slots=self._to_device(self._decode_slots(block_table, seq_lens, num_decodes), torch.int64)
            if num_decodes and self.attention_backend == "PAGED_INDUCTOR"
            else None,
        )
        return _Batch(
            req_ids=req_ids,
            input_ids=self._to_device(np.asarray(input_ids, dtype=np.int64), torch.int64),
            positions=self._to_device(positions, torch.int64),
            attn_metadata=meta,
            sample_rows=sample_rows,
            logits_indices=self._to_device(query_start_loc[1:][sample_rows] - 1, torch.int64),
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A numpy array of the step's inputs as a tensor of ``dtype`` on the device."""
        return torch.from_numpy(array).to(device=self.device, dtype=dtype, non_blocking=True)

    def _decode_slots(self, block_table: np.ndarray, seq_lens: np.ndarray, num_decodes: int) -> np.ndarray:
        """``(num_decodes, longest decode)`` int64: the flat cache slot of every key of every
        decode (rows past their length repeat whatever the table holds; attention masks them)."""
        bs = self.block_size
        pos = np.arange(int(seq_lens[:num_decodes].max()))
        return block_table[:num_decodes, pos // bs].astype(np.int64) * bs + pos % bs

    # ------------------------------------------------------------------ logprobs

    @staticmethod
    def _logprobs_lists(
        tensors: LogprobsTensors, states: list[CachedRequestState]
    ) -> dict[str, LogprobsLists]:
        """One row per requesting state: the sampled token first, then its own top N."""
        ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
        out = {}
        for j, state in enumerate(states):
            n = state.sampling_params.logprobs
            if n is not None:
                out[state.req_id] = LogprobsLists(
                    logprob_token_ids=[ids[j][: n + 1]], logprobs=[lps[j][: n + 1]], ranks=[ranks[j]]
                )
        return out

    def _prompt_logprobs(self, batch: _Batch, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Rows for the prompt positions computed this step; row k scores the prompt's next token.

        Each prompt position is reported once: ``num_prompt_logprobs_done`` advances here."""
        meta = batch.attn_metadata
        states, spans = [], []  # span: (index of the first token, its position, count)
        for row in batch.prompt_logprob_rows:
            state = self.requests[batch.req_ids[row]]
            start, end = meta.num_computed_tokens_cpu[row], meta.seq_lens_cpu[row]
            # The hidden state at position p scores prompt token p + 1.
            first = max(start, state.num_prompt_logprobs_done)
            last = min(end, state.num_prompt_tokens - 1)
            if last > first:
                states.append(state)
                spans.append((meta.query_start_loc_cpu[row] + first - start, first, last - first))
                state.num_prompt_logprobs_done = last
        if not spans:
            return {}
        index, targets = [], []
        for state, (first_token, position, count) in zip(states, spans):
            index.extend(range(first_token, first_token + count))
            targets.extend(state.prompt_token_ids[position + 1 : position + 1 + count])
        index_t = torch.tensor(index, dtype=torch.int64, device=self.device)
        logprobs = self.model.compute_logits(hidden[index_t]).log_softmax(dim=-1)  # (rows, vocab)
        max_n = max(s.sampling_params.prompt_logprobs for s in states)
        tensors = gather_logprobs(logprobs, max_n, torch.tensor(targets, device=self.device))
        ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
        out, k = {}, 0
        for state, (_, _, count) in zip(states, spans):
            n = state.sampling_params.prompt_logprobs + 1
            out[state.req_id] = LogprobsLists(
                logprob_token_ids=[r[:n] for r in ids[k : k + count]],
                logprobs=[r[:n] for r in lps[k : k + count]],
                ranks=ranks[k : k + count],
            )
            k += count
        return out

    # ------------------------------------------------------------------ dummy runs

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """One decode-sized dummy step (vLLM: ``_dummy_run(1, uniform_decode=True)``); each
        pipeline stage runs on zeros, so no stage waits for another."""
        self._dummy_step([1])

    def _dummy_step(self, query_lens: list[int], sample: bool = True) -> None:
        """A forward and (``sample``) a sampler run — a pooling model's pooler — over fresh
        dummy requests writing into the null block."""
        num_reqs = len(query_lens)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        num_tokens = starts[-1]
        positions = torch.cat([torch.arange(n) for n in query_lens]).to(self.device)
        num_decodes = sum(1 for n in query_lens if n == 1)
        meta = AttentionMetadata(
            num_reqs=num_reqs,
            num_decodes=num_decodes,
            slot_mapping=positions % self.block_size,  # block 0: the null block
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(
                (num_reqs, -(-max(query_lens) // self.block_size)), dtype=torch.int32, device=self.device
            ),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(query_lens),
            num_computed_tokens_cpu=[0] * num_reqs,
            max_decode_seq_len=1 if num_decodes else 0,
            block_size=self.block_size,
            decode_slots=torch.zeros((num_decodes, 1), dtype=torch.int64, device=self.device)
            if num_decodes and self.attention_backend == "PAGED_INDUCTOR"
            else None,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self._run_model(input_ids, positions, meta, self._dummy_intermediate(num_tokens))
        if self.is_last_stage and sample and self.is_pooling_model:
            self._dummy_pool(hidden, query_lens)
        elif self.is_last_stage and sample:
            last = torch.tensor(starts[1:], device=self.device) - 1
            self._dummy_sample(self.model.compute_logits(hidden[last]))

    def _dummy_pool(self, hidden: torch.Tensor, query_lens: list[int]) -> None:
        """Run the pooler over dummy requests of ``query_lens`` tokens (vLLM's
        ``_dummy_pooler_run``): whole prompts, so MEAN and CLS pooling run too."""
        metadata = PoolingMetadata(
            prompt_lens=list(query_lens),
            pooling_params=[PoolingParams(task="embed", use_activation=True)] * len(query_lens),
        )
        metadata.build_pooling_cursor(query_lens, query_lens, self.device)
        self.model.pooler(hidden[: sum(query_lens)], metadata)

    def _dummy_sample(self, logits: torch.Tensor) -> None:
        """Run the sampler's heaviest path (random rows with top-k, top-p and logprobs)."""
        rows = logits.shape[0]
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=min(5, self.vocab_size))
        meta = SamplingMetadata.build(
            [params] * rows,
            [[]] * rows,
            [[]] * rows,
            [None] * rows,
            [None] * rows,
            self.vocab_size,
            self.device,
        )
        self.sampler(logits, meta)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

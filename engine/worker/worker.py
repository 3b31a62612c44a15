"""``Worker``: owns one device, the model's weights on it, and its slice of the KV cache.

Mirrors vLLM's ``vllm/v1/worker/gpu_worker.py`` and ``cpu_worker.py`` in one class: the
lifecycle is the same on both devices, only memory accounting differs. Each lifecycle
method is one stage (a span and a status-file entry):

``init_device`` → ``load_model`` → ``determine_available_memory`` →
``initialize_from_config`` → ``compile_or_warm_up_model`` → ``execute_model`` (each step).

With tensor parallelism (world size > 1, multiprocess executor only) ``init_device`` joins
the engine's torch.distributed group (``engine.distributed.parallel_state``: gloo on CPU,
NCCL on CUDA) before anything else, so every later stage — weights, profiling, KV cache —
happens per rank on this rank's slice. Every rank runs every step (the broadcast queue
gives each the same ``SchedulerOutput``) and samples the same tokens from the same
all-gathered logits; only the driver (rank 0) returns them. At world size 1 no process
group is created, so many engines can live in one process (tests do this).

With pipeline parallelism (rank = pp_rank × tp + tp_rank) each worker holds one stage's
layers. Each step, a worker of a stage after the first receives the previous stage's hidden
states before running its layers, and a worker of a stage before the last sends its own on
and returns None; the last stage samples, and its TP rank 0 (rank ``(pp - 1) × tp``, the
executor's output rank) returns the step's output. One batch is in the pipeline at a time:
vLLM keeps up to ``pipeline_parallel_size`` batches in flight (the engine core's batch
queue) so that every stage is busy; that micro-batching is left out, so here a stage idles
while the others work.

On a CPU the executor builds ``CPUWorker`` (``engine/worker/cpu/cpu_worker.py``, vLLM's
``cpu_worker.py``), this class with its torch threads planned and governed: it plugs in
through ``_init_device_threads``, ``_tune_after_warm_up`` and by extending ``execute_model``,
``runs_as`` and ``telemetry_gauges``; this file imports nothing of it.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.distributed.parallel_state import get_pp_group
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.logger import init_logger
from engine.model.loader import resolve_device, resolve_dtype
from engine.model.utils import IntermediateTensors
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.moe_telemetry import MoETelemetry, moe_forward
from engine.worker.step_telemetry import WorkerStepTelemetry, compile_text
from tracing import catalogue, stage
from tracing.stage import set_runs_as

logger = init_logger(__name__)

GiB = 1 << 30


class Worker:
    """One worker: a device, a ``ModelRunner`` and the KV cache tensors.

    Args:
        config: the engine config.
        local_rank: device index on this host.
        rank: global rank in the (tensor × pipeline) group.
        distributed_init_method: torch.distributed rendezvous (unused at world size 1).
        is_driver_worker: TP rank 0 of its stage (``rank % tp == 0``); the last stage's returns
            the step's output to the engine core.
    """

    def __init__(
        self,
        config: EngineConfig,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str | None = None,
        is_driver_worker: bool = True,
    ) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.model_runner: ModelRunner | None = None
        self.step_telemetry = WorkerStepTelemetry()  # step counts and times, late graphs (glass)
        self.moe_telemetry: MoETelemetry | None = None  # a mixture of experts' load and all-to-alls (glass)

    def _attrs(self, **extra: Any) -> dict[str, Any]:
        return {catalogue.ATTR_RANK: self.rank, **extra}

    def init_device(self) -> dict[str, str]:
        """Pick the device and dtype, seed the RNGs, build the model runner.

        Returns:
            ``{"device": ..., "dtype": ...}`` as resolved (reported back to the frontend).
        """
        with stage(catalogue.WORKER_INIT_DEVICE, **self._attrs()) as st:
            mc = self.config.model_config
            self.device = resolve_device(self.config.device_config.device, self.local_rank)
            self._init_device_threads()  # before this worker's first torch op
            self.dtype = resolve_dtype(mc.dtype, mc.checkpoint_dtype, self.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._init_distributed()
            torch.manual_seed(mc.seed)
            gc.collect()
            self.model_runner = ModelRunner(self.config, self.device, self.dtype)
            info = {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}
            st.set(catalogue.ATTR_DEVICE, info["device"])
            st.set(catalogue.ATTR_MODEL_DTYPE, info["dtype"])
            logger.info("Worker rank %d on %s, dtype %s", self.rank, info["device"], info["dtype"])
            return info

    def _init_device_threads(self) -> None:
        """Set this worker's threads before its first torch op: nothing here (``CPUWorker``
        plans and pins its torch threads)."""

    def _init_distributed(self) -> None:
        """Join the TP and PP groups (world size > 1 only); rendezvous bounded by GLASSBOX_DIST_INIT_TIMEOUT_S.

        With expert parallelism across DP engines the world is every engine's workers (rank
        ``dp_rank · tp + rank``), met at the port the first process picked
        (``data_parallel_worker_port``), and it holds the EP group besides each engine's TP group.
        """
        pc = self.config.parallel_config
        if pc.world_size_across_dp == 1:
            return
        from engine.distributed import parallel_state
        from engine.distributed.topology import ProcessRole

        tp = pc.tensor_parallel_size
        init_method, rank, dp_rank = self.distributed_init_method, self.rank, pc.data_parallel_rank
        if pc.expert_parallel_across_dp:
            init_method = parallel_state.get_distributed_init_method(
                "127.0.0.1", pc.data_parallel_worker_port
            )
            rank = dp_rank * pc.world_size + self.rank
        if init_method is None:
            raise RuntimeError(
                f"world size {pc.world_size} needs a distributed_init_method (the multiprocess executor)"
            )

        def rank_name(r: int) -> str:
            if pc.expert_parallel_across_dp:
                return ProcessRole.worker_of_rank(r // pc.world_size, r % pc.world_size, tp).name
            return ProcessRole.worker_of_rank(dp_rank, r, tp).name

        assert self.device is not None
        parallel_state.init_distributed_environment(
            pc.world_size_across_dp,
            rank,
            init_method,
            self.local_rank,
            backend="nccl" if self.device.type == "cuda" else "gloo",
            rank_name=rank_name,
        )
        parallel_state.ensure_model_parallel_initialized(
            tp,
            pc.pipeline_parallel_size,
            pc.data_parallel_size if pc.expert_parallel_across_dp else 1,
            pc.enable_expert_parallel,
        )

    def get_comm_stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds in ``execute_model``, in TP collectives, PP hand-offs and EP all-to-alls (and
        their calls), and a mixture of experts' phases (``MoETelemetry.times``), for benchmarks."""
        from engine.distributed import parallel_state

        out = {"execute_model_s": self.step_telemetry.execute_model_s, **parallel_state.get_comm_stats(reset)}
        if self.moe_telemetry is not None:  # a mixture of experts: its phases' seconds too
            out.update(self.moe_telemetry.times(reset))
        if reset:
            self.step_telemetry.execute_model_s = 0.0
        return out

    def load_model(self) -> None:
        with stage(catalogue.WORKER_LOAD_MODEL, **self._attrs()) as st:
            assert self.model_runner is not None, "init_device first"
            self.model_runner.load_model()
            if self.model_runner.moe_layers:
                detailed = self.config.observability_config.collect_model_forward_time
                self.moe_telemetry = MoETelemetry(self.model_runner.moe_layers, detailed)
            st.set(catalogue.ATTR_MODEL_NAME, self.config.model_config.served_model_name)
            model_config = self.config.model_config
            logger.info(
                "Loaded %s%s: %s",
                model_config.architecture,
                " as an embedding model (--convert embed)" if model_config.convert_type == "embed" else "",
                self.model_runner.describe_model_memory(),
            )

    def get_kv_cache_spec(self) -> FullAttentionSpec:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache, after a profile run at the max batch.

        CPU: ``--kv-cache-memory-bytes`` or ``GLASSBOX_CPU_KVCACHE_SPACE`` GiB (a fixed
        budget, never a share of system memory). CUDA: ``--kv-cache-memory-bytes``, else
        ``total × gpu_memory_utilization − (weights + peak activations + non-torch)``.
        """
        with stage(catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY, **self._attrs()) as st:
            assert self.model_runner is not None and self.device is not None
            cache_config = self.config.cache_config
            if self.device.type != "cuda":
                self.model_runner.profile_run()
                available = cache_config.kv_cache_memory_bytes or int(envs.GLASSBOX_CPU_KVCACHE_SPACE * GiB)
            elif cache_config.kv_cache_memory_bytes:
                self.model_runner.profile_run()
                available = cache_config.kv_cache_memory_bytes
            else:
                available = self._profile_cuda_memory()
            st.set(catalogue.ATTR_KV_AVAILABLE_BYTES, available)
            return available

    def _profile_cuda_memory(self) -> int:
        assert self.model_runner is not None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        requested = total * self.config.cache_config.gpu_memory_utilization
        if free < requested - self.model_runner.model_memory_usage:
            raise ConfigError(
                "--gpu-memory-utilization",
                self.config.cache_config.gpu_memory_utilization,
                f"free memory on the device ({free / GiB:.2f} GiB) is less than the desired "
                f"utilization ({requested / GiB:.2f} GiB): lower it or free memory used by other processes",
            )
        before = torch.cuda.memory_stats(self.device)["allocated_bytes.all.peak"]
        self.model_runner.profile_run()
        peak = torch.cuda.memory_stats(self.device)["allocated_bytes.all.peak"]
        free_after, _ = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free_after) - torch.cuda.memory_reserved(self.device)
        non_kv = self.model_runner.model_memory_usage + (peak - before) + max(non_torch, 0)
        gc.collect()
        torch.cuda.empty_cache()
        return int(requested - non_kv)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache tensors and bind them to the attention layers."""
        with stage(
            catalogue.WORKER_INITIALIZE_KV_CACHE,
            **self._attrs(**{catalogue.ATTR_KV_NUM_BLOCKS: kv_cache_config.num_blocks}),
        ):
            assert self.model_runner is not None
            self.model_runner.initialize_kv_cache(kv_cache_config)
            runner = self.model_runner
            if runner.moe_layers:  # where this rank's memory goes: KV cache, experts, the rest
                kv = kv_cache_config.num_blocks * kv_cache_config.spec.bytes_per_block
                logger.info("Memory of rank %d: KV cache %.1f MiB, routed experts %.1f MiB (%s), other weights "
                            "%.1f MiB", self.rank, kv / 2**20, runner.model_expert_bytes / 2**20,
                            runner.describe_experts(),
                            (runner.model_weight_bytes - runner.model_expert_bytes) / 2**20)  # fmt: skip

    def compile_or_warm_up_model(self) -> None:
        """Compile the forward (unless eager) and run a few dummy steps, so the first request
        does not pay one-time costs; the stage records the mode, graphs and compile seconds."""
        with stage(catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL, **self._attrs()) as st:
            assert self.model_runner is not None
            compiled = self._tune_after_warm_up(self.model_runner.warm_up())
            st.set(catalogue.ATTR_COMPILE_MODE, compiled["mode"])
            st.set(catalogue.ATTR_COMPILE_NUM_GRAPHS, compiled["graphs"])
            st.set(catalogue.ATTR_COMPILE_CACHE, compiled["cache"])
            st.set(catalogue.ATTR_COMPILE_SECONDS, round(compiled["seconds"], 3))
            torch.manual_seed(self.config.model_config.seed)
            if self.moe_telemetry is not None:
                self.moe_telemetry.reset()  # the experts' load counts serving only
        set_runs_as(self.runs_as(compiled))

    def _tune_after_warm_up(self, compiled: dict[str, Any]) -> dict[str, Any]:
        """Tune the warm step for this machine and return ``compiled`` as it then stands:
        nothing here (``CPUWorker`` times its threads and compiled-or-eager)."""
        return compiled

    def runs_as(self, compiled: dict[str, Any]) -> dict[str, str]:
        """How this worker runs its model, for its status file (``glassbox ps``, ``doctor``):
        device, dtype, compile mode (with ``compiled``: ``warm_up``'s answer), attention
        backend (``CPUWorker`` adds its threads)."""
        assert self.model_runner is not None and self.device is not None and self.dtype is not None
        facts = {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                 "compile": compile_text(compiled["mode"], compiled["graphs"]),
                 "attention": str(self.model_runner.attention_backend)}  # fmt: skip
        return facts

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        intermediate_tensors = None
        with self.step_telemetry.step(self.model_runner), moe_forward(self.moe_telemetry):
            if not self.model_runner.is_first_stage and scheduler_output.total_num_scheduled_tokens > 0:
                intermediate_tensors = self._recv_intermediate_tensors()
            output = self.model_runner.execute_model(scheduler_output, intermediate_tensors)
            if isinstance(output, IntermediateTensors):  # a pipeline rank before the last
                get_pp_group().send_tensor_dict(output.tensors)  # on to the next stage, not the engine core
                return None
        return output if self.is_driver_worker else None

    def _recv_intermediate_tensors(self) -> IntermediateTensors:
        """The previous pipeline stage's hidden states for this step (blocks until they arrive).

        Received as inference tensors, like the warm-up's: a compiled forward guards on that,
        and a plain tensor would make it compile a second graph."""
        with torch.inference_mode():
            return IntermediateTensors(get_pp_group().recv_tensor_dict(device=self.device))

    def telemetry_gauges(self) -> dict[str, float]:
        """Live-telemetry gauges: execute_model calls so far and the last one's time (ms), and a
        mixture of experts' load and all-to-all time (``CPUWorker`` adds its thread counts)."""
        gauges = self.step_telemetry.gauges()
        if self.moe_telemetry is not None:
            gauges.update(self.moe_telemetry.gauges())
        return gauges

    def execute_dummy_batch(self) -> None:
        """A one-token dummy forward (and sampler run) into the null block: what an engine
        without requests runs while its data-parallel wave runs (vLLM: ``execute_dummy_batch``)."""
        assert self.model_runner is not None
        with stage(catalogue.WORKER_EXECUTE_DUMMY_BATCH, **self._attrs()), moe_forward(self.moe_telemetry):
            self.model_runner.execute_dummy_batch()
        self.step_telemetry.note_late_graphs(self.model_runner)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.model_runner = None
        if self.config.parallel_config.world_size_across_dp > 1:
            from engine.distributed import parallel_state

            parallel_state.destroy_distributed_environment()

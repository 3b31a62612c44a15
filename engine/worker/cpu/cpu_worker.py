"""``CPUWorker``: a ``Worker`` whose torch threads are planned, pinned and governed.

Mirrors vLLM's ``vllm/v1/worker/cpu_worker.py`` (``CPUWorker.init_device`` binds the OpenMP
threads). On a CPU, ``init_device`` first sets this worker's torch (OpenMP) threads: how many,
and on which CPUs (``GLASSBOX_CPU_OMP_THREADS_BIND``; ``cpu_threads.py``). A worker with two or
more threads then runs with fewer while other processes take its CPUs (``CpuThreadGovernor``,
``GLASSBOX_CPU_ADAPTIVE_THREADS``), so its threads may spin briefly between parallel regions
(``GOMP_SPINCOUNT=10000``), which is faster on a quiet machine. The status file's
``cpu_threads`` and the live gauges ``worker.cpu_threads``/``worker.cpu_threads_max`` say
how many it runs with now, of its share.
"""

from __future__ import annotations

import os
from typing import Any

from engine import envs
from engine.model.cpu.op_threads import get_op_threads, set_op_threads
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.worker.cpu.cpu_thread_governor import CpuThreadGovernor
from engine.worker.cpu.cpu_threads import (
    CpuThreadPlan,
    _cpu_ranges,
    _usable_cpus,
    apply_cpu_threads,
    plan_cpu_threads,
)
from engine.worker.worker import Worker, logger
from tracing.stage import set_runs_as
from tracing.telemetry import events


class CPUWorker(Worker):
    """A ``Worker`` on the CPU (same arguments): threads set in ``init_device``, governed
    around each ``execute_model``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._governor: CpuThreadGovernor | None = None  # the adaptive thread count, when on
        self._thread_plan: CpuThreadPlan | None = None  # init_device's plan, on a CPU

    def _init_device_threads(self) -> None:
        if self.device.type == "cpu":
            self._init_cpu_threads()

    def _init_cpu_threads(self) -> None:
        """Set this worker's torch threads and CPU affinity (``GLASSBOX_CPU_OMP_THREADS_BIND``)
        and log what it got; the result is also ``cpu_threads_info()``."""
        from engine.logger import get_process_role

        pc = self.config.parallel_config
        if get_process_role() == "Main":  # the caller's process: its count, not what an earlier engine chose
            set_op_threads(None)
        plan = plan_cpu_threads(
            envs.GLASSBOX_CPU_OMP_THREADS_BIND,
            worker_index=pc.data_parallel_rank * pc.world_size + self.rank,
            num_workers=pc.data_parallel_size * pc.world_size,
            usable_cpus=_usable_cpus(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS") or None,
            own_process=get_process_role() != "Main",
        )
        apply_cpu_threads(plan)
        self._thread_plan = plan
        info = self.cpu_threads_info()
        governor = None
        # In the caller's process (auto) torch's count is left as the caller set it, and the
        # governor follows the load below it all the same: Glassbox's own parallel work runs
        # inside op_threads(), which puts the caller's count back after each op. Without it, a
        # busy machine held a 2-thread team waiting on a starved thread at every matmul
        # (libgomp's own long spin there too): 26 against 201 tok/s with one thread.
        most = plan.num_threads if plan.num_threads is not None else (
            get_op_threads() if plan.why.startswith("auto") else None)  # fmt: skip
        if envs.GLASSBOX_CPU_ADAPTIVE_THREADS and most is not None and most >= 2:
            governor = CpuThreadGovernor(most, plan.cpus or tuple(sorted(_usable_cpus())),
                                         name=f"Worker rank {self.rank} on CPUs {info['cpus']}")  # fmt: skip
        self._governor = governor if governor is not None and governor.enabled else None
        logger.info(
            "Worker rank %d: %d torch thread(s) on CPUs %s (%s%s); OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s",
            self.rank, info["num_threads"], info["cpus"], plan.why,
            ", fewer while other processes take CPUs" if self._governor else "",
            info["omp_wait_policy"], info["gomp_spincount"],
        )  # fmt: skip

    def cpu_threads_info(self) -> dict[str, Any]:
        """This worker's torch thread count, the CPUs it may run on (``"0-1"``) and the OpenMP
        wait variables it was started with (``"unset"`` when absent), for tests and benchmarks."""
        return {
            "num_threads": get_op_threads(),
            "cpus": _cpu_ranges(tuple(_usable_cpus())),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "unset"),
        }

    def _threads_text(self) -> str:
        if self._governor is None:
            return str(get_op_threads())
        return f"{get_op_threads()} of {self._governor.max_threads}"

    def _tune_after_warm_up(self, compiled: dict[str, Any]) -> dict[str, Any]:
        """On a CPU, time the warm step's thread counts, compiled against eager and the fused
        loops' threads (``step_choices.tune_step``), apply the verdicts and add them to the model's measured
        choices; ``compiled["mode"]`` becomes ``"eager"`` where eager won. Skipped where the
        forward holds collectives (every rank would have to time the same steps)."""
        if self.device.type != "cpu" or self._thread_plan is None or self.model_runner is None:
            return compiled
        from engine.model.cpu.op_threads import set_fused_loop_threads
        from engine.worker.cpu.step_choices import (
            forced_fused_loop_threads,
            forward_has_collectives,
            tune_step,
        )

        runner = self.model_runner
        if forward_has_collectives(self.config):
            forced = forced_fused_loop_threads(envs.GLASSBOX_CPU_FUSED_LOOP_THREADS)
            if forced is not None and runner.compiled is not None:  # nothing timed here: all, unless forced
                set_fused_loop_threads(forced.data["decode_all"], forced.data["prefill_all"])
                runner.model.measured_choices = [*getattr(runner.model, "measured_choices", []), forced]
            self._tune_attention_task_shape()  # the kernel alone: no collective in it
            return compiled
        plan = self._thread_plan
        share = plan.num_threads or get_op_threads()
        verdicts = tune_step(runner, share, plan.cpus or tuple(sorted(_usable_cpus())),
                             threads_fixed=_threads_fixed(plan), compile_fixed=self._compile_fixed(),
                             loops_setting=envs.GLASSBOX_CPU_FUSED_LOOP_THREADS)  # fmt: skip
        for verdict in verdicts:
            logger.info("%s", verdict.text())
        runner.model.measured_choices = [*getattr(runner.model, "measured_choices", []), *verdicts]
        threads = verdicts[0].data["threads"]
        if self._governor is not None:
            self._governor.max_threads = self._governor.num_threads = threads
            if not self._governor.enabled:  # one thread: nothing left to govern
                self._governor = None
        self._tune_attention_task_shape()
        if runner.compiled is None and compiled["mode"] != "eager":
            compiled = {"mode": "eager", "graphs": 0, "cache": "off", "seconds": 0.0}
        return compiled

    def _tune_attention_task_shape(self) -> None:
        """With the C++ decode kernel (``CPU_PAGED_CPP``): time its task shapes at this model's
        heads and thread count (``paged_attention_cpu.choose_task_shape``) and use the verdict."""
        runner = self.model_runner
        if runner.attention_backend != "CPU_PAGED_CPP" or not runner.attention_layers:
            return
        from engine.model.cpu import paged_attention_cpu
        from engine.model.cpu.op_threads import op_threads

        layer = runner.attention_layers[0]
        with op_threads():
            verdict = paged_attention_cpu.choose_task_shape(layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                                            runner.dtype, runner.block_size, get_op_threads())  # fmt: skip
        paged_attention_cpu.all_heads_from = verdict.data["all_heads_from"]
        logger.info("%s", verdict.text())
        runner.model.measured_choices = [*getattr(runner.model, "measured_choices", []), verdict]

    def _compile_fixed(self) -> str | None:
        """What fixed compiled-or-eager (``--enforce-eager``, ``GLASSBOX_TORCH_COMPILE=1``), or
        None where it is to be measured."""
        if self.config.model_config.enforce_eager:
            return "--enforce-eager"
        if envs.GLASSBOX_TORCH_COMPILE != "auto":
            return f"GLASSBOX_TORCH_COMPILE={int(bool(envs.GLASSBOX_TORCH_COMPILE))}"
        return None

    def runs_as(self, compiled: dict[str, Any]) -> dict[str, str]:
        """``Worker.runs_as`` and, on a CPU, its threads (now / its share), the pages its KV
        cache lies on (``kv_cache_pages``: ``2 MiB pages``) and the speed choices measured for
        its model (``bf16_linear``: ``native (measured)``)."""
        facts = super().runs_as(compiled)
        if self.device.type == "cpu":
            facts["cpu_threads"] = self._threads_text()
            if self.model_runner is not None and self.model_runner.kv_cache_pages:
                facts["kv_cache_pages"] = self.model_runner.kv_cache_pages
            model = self.model_runner.model if self.model_runner is not None else None
            for verdict in getattr(model, "measured_choices", ()):  # engine/model/cpu/measured_choice.py
                facts[verdict.name] = verdict.short()
        return facts

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """``Worker.execute_model`` between the governor's step hooks; a new thread count
        goes into the status file at once."""
        if self._governor is None:
            return super().execute_model(scheduler_output)
        self._governor.step_started()
        output = super().execute_model(scheduler_output)
        changes = self._governor.changes
        self._governor.step_finished()
        if self._governor.changes != changes:
            set_runs_as({"cpu_threads": self._threads_text()})
        return output

    def shutdown(self) -> None:
        """``Worker.shutdown``, and the step's thread count (process-wide, ``op_threads.py``)
        back to torch's: an engine in the caller's process leaves its choice behind for no
        one, and the next engine there starts from the caller's count."""
        super().shutdown()
        set_op_threads(None)

    def telemetry_gauges(self) -> dict[str, float]:
        """``Worker.telemetry_gauges`` and, on a CPU, the step's thread count now and the most
        it runs with (its share)."""
        gauges = super().telemetry_gauges()
        if self.device is not None and self.device.type == "cpu":
            gauges[events.GAUGE_WORKER_THREADS] = get_op_threads()
            governor = self._governor  # read once: the step thread may set it to None meanwhile
            most = governor.max_threads if governor is not None else get_op_threads()
            gauges[events.GAUGE_WORKER_THREADS_MAX] = most
        return gauges


def _threads_fixed(plan: CpuThreadPlan) -> str | None:
    """What fixed a plan's thread count (``OMP_NUM_THREADS=4``, a CPU list), or None under
    ``auto`` with nothing set, where ``step_choices`` times it."""
    if plan.num_threads is None:
        return plan.why
    if "OMP_NUM_THREADS" in plan.why:
        return "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "")
    if not plan.why.startswith("auto"):
        return plan.why
    return None

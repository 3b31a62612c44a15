"""A CPU worker's step, tuned by timing it: how many threads, compiled or eager, and the
threads of the compiled step's own loops.

Three choices about a whole step depend on the machine more than on the model:

- **Threads.** A worker runs its step's parallel work (the oneDNN linears, the attention
  kernel) on its share of the CPUs, one thread each. Whether every thread pays off depends on
  the CPU: two hyper-threads of one core share its multiply-add units, a small model's
  decode step is over before a team of threads has woken up, a VM's virtual CPUs may sit on
  the same physical core. So the candidates — the whole share, half of it, and the share's
  physical cores where some of its CPUs are hyper-thread siblings — are timed on the worker's
  own dummy steps.
- **Compiled or eager.** The compiled step (``engine/model/cpu/compile.py``) fuses the small
  operations between the matmuls into C++ loops; on some machines the eager step's own
  small ops can be faster. So the compiled step is timed against the eager one, and the
  eager one is kept only where it wins clearly, at a decode batch and at a prefill chunk alike.
- **The fused loops' threads.** Those loops are OpenMP parallel regions over a few thousand
  numbers in a decode step, and a prefill's hundreds of thousands: waking the team for each
  can cost more than it saves (it did, with threads that slept while they waited), or halve
  the loops' time. So the compiled step is timed with its loops on all of the step's threads
  and on one, for decode steps and for prefill steps apart (``op_threads.compiled_step_threads``
  applies the verdict); the linears and attention use all of them either way.

All three are timed on the worker's own dummy steps (``ModelRunner._dummy_step``: a decode batch and
a prefill chunk writing into the null block), interleaved, medians (``measured_choice.py``),
once per machine, model shape, dtype and thread share: the verdict is cached beside the compile
cache and shown in the worker's status (``runs_as``: ``step_threads``, ``compiled_step``,
``fused_loop_threads``).
Nothing is measured when the forward holds collectives (tensor or pipeline parallelism, expert
parallelism): every rank must run the same dummy steps, and a rank that read the verdict from
the cache while another measured would leave that one waiting in its first all-reduce.

Forcing a side: ``OMP_NUM_THREADS`` (or ``GLASSBOX_CPU_OMP_THREADS_BIND``) fixes the thread
count; ``--enforce-eager`` (or ``GLASSBOX_TORCH_COMPILE=0``) runs eagerly and
``GLASSBOX_TORCH_COMPILE=1`` keeps the compiled step without timing it;
``GLASSBOX_CPU_FUSED_LOOP_THREADS=one|all`` fixes the fused loops' threads.

vLLM counterpart: none — vLLM's CPU worker binds one OpenMP thread per CPU it is given and
always compiles (unless ``--enforce-eager``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.model.cpu.measured_choice import Verdict, measured, time_candidates
from engine.model.cpu.op_threads import set_fused_loop_threads, set_op_threads

if TYPE_CHECKING:
    from engine.worker.model_runner import ModelRunner

# Eager must be at least this much faster, at the decode batch and at the prefill chunk, to
# replace the compiled step (the default, and the graph the tests check).
EAGER_MIN_GAIN = 1.2
# Fewer threads must be at least this much faster than the whole share to be chosen.
FEWER_THREADS_MIN_GAIN = 1.05
# One thread must be at least this much faster than all of the step's threads, at a kind of
# step (decodes only, or with prompt tokens), to run that kind's fused loops on one.
ONE_LOOP_THREAD_MIN_GAIN = 1.05
# Rounds of the interleaved timing (each round runs every candidate once on each shape).
ROUNDS = 5


def forward_has_collectives(config: Any) -> bool:
    """Whether the model's forward waits on other ranks (tensor, pipeline or expert
    parallelism): then no rank may time steps on its own."""
    pc = config.parallel_config
    return pc.world_size > 1 or bool(getattr(pc, "enable_expert_parallel", False))


# The prefill chunk timed: 256 tokens for a model of up to 25 M parameters, fewer for a larger
# one (a 0.5 B model's 256-token chunk takes seconds on 2 cores; timed 20 times at start-up
# that would be most of the start), at least 16.
PREFILL_TOKENS, PREFILL_PARAMS = 256, 25_000_000


def step_shapes(
    max_num_reqs: int, max_num_tokens: int, max_model_len: int, num_params: int = 0
) -> dict[str, list[int]]:
    """The dummy steps timed, as ``ModelRunner._dummy_step`` query lengths: a decode batch of
    up to 16 requests and one prefill chunk of up to 256 tokens (fewer for a model of more
    than ``PREFILL_PARAMS`` parameters)."""
    decodes = max(1, min(16, max_num_reqs, max_num_tokens))
    chunk = (
        PREFILL_TOKENS
        if num_params <= PREFILL_PARAMS
        else max(16, PREFILL_TOKENS * PREFILL_PARAMS // num_params)
    )
    prefill = max(1, min(chunk, max_num_tokens, max_model_len))
    return {f"{decodes} decodes": [1] * decodes, f"a {prefill}-token prefill": [prefill]}


def thread_candidates(share: int, physical_cores: int | None) -> list[int]:
    """The thread counts worth timing for a worker whose share is ``share`` CPUs: the share,
    half of it, and its physical cores (when fewer than ``share``: hyper-thread siblings)."""
    counts = {share, max(1, share // 2)}
    if physical_cores is not None and 1 <= physical_cores < share:
        counts.add(physical_cores)
    return sorted(counts, reverse=True)


def physical_cores_of(cpus: Sequence[int]) -> int | None:
    """How many physical cores ``cpus`` sit on (``/sys``'s core and package ids), None where
    that cannot be read."""
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return None
        cores.add((package, core))
    return len(cores) or None


def choose_step_threads(
    candidates: Sequence[int],
    shapes: Mapping[str, object],
    time_threads: Callable[[], dict[int, dict[str, float]]],
    key: Mapping[str, Any],
) -> Verdict:
    """How many threads this worker's steps run with, by measurement.

    Args:
        candidates: thread counts, the whole share first (``thread_candidates``).
        shapes: the timed steps by name (only their names are used here, for the detail).
        time_threads: ``() -> {threads: {shape name: median seconds}}`` for every candidate
            (interleaved); tests pass a fake.
        key: what the verdict depends on besides the CPU (model shape, dtype, share).

    Returns:
        A ``Verdict`` whose ``data["threads"]`` is the count with the least total time, if it
        beats the whole share by ``FEWER_THREADS_MIN_GAIN`` — else the whole share. Timed
        while other processes held a CPU (``measured_choice.BUSY_CPUS``), the whole share:
        fewer threads always win then, and the governor already lowers the count under load.
    """
    share = candidates[0]
    if len(candidates) == 1:
        return Verdict("step_threads", str(share), "the only candidate", data={"threads": share})

    def measure() -> tuple[str, str, dict]:
        times = time_threads()
        totals = {n: sum(t.values()) for n, t in times.items()}
        best = min(totals, key=totals.get)
        if best != share and totals[share] < FEWER_THREADS_MIN_GAIN * totals[best]:
            best = share
        detail = "; ".join(
            f"{name}: "
            + ", ".join(
                f"{n} thread{'s' if n != 1 else ''} {1e3 * times[n][name]:.2f} ms" for n in candidates
            )
            for name in shapes
        )
        return str(best), detail, {"threads": best}

    return measured("step_threads", {**key, "candidates": list(candidates), "rounds": ROUNDS}, measure,
                    busy_default=(str(share), {"threads": share}))  # fmt: skip


def choose_compiled_step(
    shapes: Mapping[str, object],
    time_modes: Callable[[], dict[str, dict[str, float]]],
    key: Mapping[str, Any],
) -> Verdict:
    """Whether this worker's steps run compiled or eagerly, by measurement.

    Args:
        shapes: the timed steps by name.
        time_modes: ``() -> {"compiled": {shape: s}, "eager": {shape: s}}``; tests pass a fake.
        key: what the verdict depends on besides the CPU.

    Returns:
        A ``Verdict`` whose ``data["compiled"]`` is False only where eager measured at least
        ``EAGER_MIN_GAIN``× faster at every timed shape, and not timed while the machine was busy.
    """

    def measure() -> tuple[str, str, dict]:
        t = time_modes()
        eager_wins = all(t["compiled"][name] >= EAGER_MIN_GAIN * t["eager"][name] for name in shapes)
        detail = "; ".join(
            f"{name}: compiled {1e3 * t['compiled'][name]:.2f} ms, eager {1e3 * t['eager'][name]:.2f} ms"
            for name in shapes
        )
        return ("eager" if eager_wins else "compiled"), detail, {"compiled": not eager_wins}

    return measured("compiled_step", {**key, "rounds": ROUNDS, "min_gain": EAGER_MIN_GAIN}, measure,
                    busy_default=("compiled", {"compiled": True}))  # fmt: skip


ALL_LOOP_THREADS = {"decode_all": True, "prefill_all": True}


def fused_loop_words(data: Mapping[str, bool]) -> str:
    """A ``fused_loop_threads`` verdict's data in words: ``all threads``, ``one thread``, or
    ``one thread in decode steps, all in prefill steps`` (and the other way round)."""
    decode, prefill = data["decode_all"], data["prefill_all"]
    if decode == prefill:
        return "all threads" if decode else "one thread"
    return f"{'all threads' if decode else 'one thread'} in decode steps, {'all' if prefill else 'one'} in prefill steps"


def forced_fused_loop_threads(setting: str) -> Verdict | None:
    """The verdict ``GLASSBOX_CPU_FUSED_LOOP_THREADS`` forces (``one`` / ``all``); None for ``auto``."""
    if setting == "auto":
        return None
    data = {"decode_all": setting == "all", "prefill_all": setting == "all"}
    return Verdict("fused_loop_threads", fused_loop_words(data),
                   f"forced by GLASSBOX_CPU_FUSED_LOOP_THREADS={setting}", data=data)  # fmt: skip


def choose_fused_loop_threads(
    shapes: Mapping[str, list[int]],
    time_settings: Callable[[], dict[str, dict[str, float]]],
    key: Mapping[str, Any],
) -> Verdict:
    """Whether the compiled step's own fused loops run on all of the step's threads or on one,
    for decode steps and for prefill steps, by measurement.

    Args:
        shapes: the timed steps by name, as query lengths (a step whose longest is 1 is a
            decode step, any other a prefill step).
        time_settings: ``() -> {"all": {shape: s}, "one": {shape: s}}``; tests pass a fake.
        key: what the verdict depends on besides the CPU.

    Returns:
        A ``Verdict`` whose ``data`` says, for ``"decode_all"`` and ``"prefill_all"``, whether
        that kind of step's loops use all threads: False only where one thread measured at
        least ``ONE_LOOP_THREAD_MIN_GAIN``× faster at that kind's step. All threads where it
        was timed while the machine was busy (one thread always wins then).
    """

    def measure() -> tuple[str, str, dict]:
        t = time_settings()
        data = dict(ALL_LOOP_THREADS)
        for name, lens in shapes.items():
            kind = "prefill_all" if max(lens) > 1 else "decode_all"
            data[kind] = t["all"][name] < ONE_LOOP_THREAD_MIN_GAIN * t["one"][name]
        detail = "; ".join(
            f"{name}: all threads {1e3 * t['all'][name]:.2f} ms, one thread {1e3 * t['one'][name]:.2f} ms"
            for name in shapes
        )
        return fused_loop_words(data), detail, data

    return measured("fused_loop_threads", {**key, "rounds": ROUNDS, "min_gain": ONE_LOOP_THREAD_MIN_GAIN},
                    measure, busy_default=(fused_loop_words(ALL_LOOP_THREADS), dict(ALL_LOOP_THREADS)))  # fmt: skip


# The parts of the checkpoint's config.json that change a step's cost.
MODEL_SHAPE_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")  # fmt: skip


def _interleaved(
    runner: ModelRunner, shapes: Mapping[str, list[int]], settings: Mapping[str, Callable[[], None]]
) -> dict[str, dict[str, float]]:
    """Median seconds of each dummy step under each setting (``settings``: name -> a function
    that puts it in place), every (setting, shape) pair one candidate of one interleaved
    timing: a burst of other load falls on all of them alike."""

    def run(setting: Callable[[], None], query_lens: list[int]) -> Callable[[], None]:
        def call() -> None:
            setting()
            runner._dummy_step(query_lens, sample=False)  # the forward: what the settings change

        return call

    candidates = {(s, name): run(fn, q) for s, fn in settings.items() for name, q in shapes.items()}
    with torch.inference_mode():  # as the warm-up's and the real steps' (a compiled graph guards on it)
        times = time_candidates(candidates, rounds=ROUNDS, timer=time.perf_counter)
    return {s: {name: times[(s, name)] for name in shapes} for s in settings}


def tune_step(
    runner: ModelRunner,
    share: int,
    cpus: Sequence[int],
    threads_fixed: str | None,
    compile_fixed: str | None,
    loops_setting: str = "auto",
) -> list[Verdict]:
    """Choose the worker's step threads, compiled-or-eager mode and (compiled, several threads)
    the fused loops' threads by timing its dummy steps, and apply them (``set_op_threads``;
    ``runner.compiled = None`` for eager; ``set_fused_loop_threads``). Call after
    ``ModelRunner.warm_up``, on a CPU, when the forward holds no collectives.

    Args:
        share: the worker's thread share (its plan).
        cpus: the CPUs of that share.
        threads_fixed: what fixed the thread count (``OMP_NUM_THREADS=4``), or None to choose it.
        compile_fixed: what fixed compiled-or-eager (``--enforce-eager``), or None to choose it.
        loops_setting: ``GLASSBOX_CPU_FUSED_LOOP_THREADS`` (``auto``: choose the compiled
            step's fused-loop threads by timing; ``one`` / ``all``: that).

    Returns the verdicts (forced ones included), for ``model.measured_choices``.
    """
    shapes = step_shapes(
        runner.max_num_reqs, runner.max_num_tokens, runner.max_model_len, runner.model_num_params
    )
    hf = runner.model_config.hf_config
    key = {"model": {k: hf[k] for k in MODEL_SHAPE_KEYS if k in hf}, "dtype": str(runner.dtype),
           "share": share, "attention": runner.attention_backend,
           "shapes": {name: len(q) for name, q in shapes.items()}}  # fmt: skip
    compiled = runner.compiled
    verdicts = []
    if threads_fixed is not None:
        verdicts.append(
            Verdict("step_threads", str(share), f"forced by {threads_fixed}", data={"threads": share})
        )
    else:
        candidates = thread_candidates(share, physical_cores_of(cpus))

        def time_threads() -> dict[int, dict[str, float]]:
            try:
                t = _interleaved(runner, shapes, {n: (lambda n=n: set_op_threads(n)) for n in candidates})
            finally:
                set_op_threads(share)
            return t

        verdicts.append(choose_step_threads(candidates, shapes, time_threads,
                                            {**key, "compiled": compiled is not None}))  # fmt: skip
    threads = verdicts[-1].data["threads"]
    set_op_threads(threads)
    if compile_fixed is not None or compiled is None:
        mode = "eager" if compiled is None else "compiled"
        why = compile_fixed or "no compiled step to time"
        verdicts.append(Verdict("compiled_step", mode, f"forced by {why}" if compile_fixed else why,
                                data={"compiled": compiled is not None}))  # fmt: skip
    else:

        def set_compiled() -> None:
            runner.compiled = compiled

        def set_eager() -> None:
            runner.compiled = None

        def time_modes() -> dict[str, dict[str, float]]:
            try:
                return _interleaved(runner, shapes, {"compiled": set_compiled, "eager": set_eager})
            finally:
                runner.compiled = compiled

        verdict = choose_compiled_step(shapes, time_modes, {**key, "threads": threads})
        if not verdict.data["compiled"]:
            runner.compiled = None
        verdicts.append(verdict)
    if runner.compiled is None or threads == 1:
        return verdicts  # no fused loops, or one thread for everything: nothing to choose
    verdict = forced_fused_loop_threads(loops_setting)
    if verdict is None:

        def time_settings() -> dict[str, dict[str, float]]:
            try:
                return _interleaved(runner, shapes, {"all": lambda: set_fused_loop_threads(True, True),
                                                     "one": lambda: set_fused_loop_threads(False, False)})  # fmt: skip
            finally:
                set_fused_loop_threads(True, True)

        verdict = choose_fused_loop_threads(shapes, time_settings, {**key, "threads": threads})
    set_fused_loop_threads(verdict.data["decode_all"], verdict.data["prefill_all"])
    verdicts.append(verdict)
    return verdicts

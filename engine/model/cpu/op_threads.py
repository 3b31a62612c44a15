"""The thread count of a step's parallel work, set apart from torch's global count.

A CPU worker's thread governor (``engine/worker/cpu/cpu_thread_governor.py``) lowers the number
of threads while other processes take the worker's CPUs. It does not simply call
``torch.set_num_threads``: an engine in the caller's process would change the caller's own
count, and while the compiled forward kept Dynamo's guard on the global state ("GLOBAL_STATE
changed: num_threads"; it keeps only its inputs' guards now, ``compile.py``) a new count
compiled a second graph in the middle of serving. So the count is kept here, and the work that
runs in parallel sets it around itself:

- in a compiled step, the opaque ops where the parallel work is — the oneDNN linears
  (``glassbox::onednn_linear``) and attention (``glassbox::attention``) — enter
  ``op_threads()``; Inductor's own kernels run on one thread anyway
  (``engine/model/cpu/compile.py``);
- an eager step and the sampler run whole inside ``op_threads()``;
- a compiled step's own fused loops (Inductor's norms, RoPE, SiLU·mul, adds) read torch's
  count when they run (``compile.py`` builds them with OpenMP's dynamic thread count), so
  ``compiled_step_threads()`` sets it around the compiled call: the step's count, or one
  thread where the worker measured one faster for that kind of step
  (``engine/worker/cpu/step_choices.py``, ``fused_loop_threads``).

``op_threads()`` sets torch's count for the block and puts it back after (0.14 µs a call).
vLLM has no counterpart (its CPU worker keeps one OpenMP thread per core).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_op_threads: int | None = None
# Whether a compiled step's fused loops run on all of the step's threads (else on one), for
# steps of decodes only and for steps with prompt tokens.
_fused_loops_on_all = {"decode": True, "prefill": True}


def set_op_threads(num_threads: int | None) -> None:
    """Run parallel step work with ``num_threads`` threads from now on (None: torch's count).

    Raises:
        ValueError: ``num_threads`` is below 1.
    """
    global _op_threads
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    _op_threads = num_threads


def get_op_threads() -> int:
    """The thread count parallel step work runs with now."""
    return _op_threads if _op_threads is not None else torch.get_num_threads()


@contextlib.contextmanager
def _torch_threads(wanted: int | None) -> Iterator[None]:
    """Run the block with ``wanted`` as torch's thread count (None: as it is), then put it back."""
    saved = torch.get_num_threads()
    if wanted is None or saved == wanted:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def op_threads() -> contextlib.AbstractContextManager[None]:
    """Run the block with ``set_op_threads``'s count as torch's thread count."""
    return _torch_threads(_op_threads)


def set_fused_loop_threads(decode_all: bool, prefill_all: bool) -> None:
    """Whether a compiled step's fused loops run on all of the step's threads (True) or on one,
    in steps of decodes only (``decode_all``) and in steps with prompt tokens (``prefill_all``)."""
    _fused_loops_on_all["decode"], _fused_loops_on_all["prefill"] = decode_all, prefill_all


def fused_loop_threads(has_prefill: bool) -> int:
    """Threads for a compiled step's fused loops now: ``get_op_threads()``, or 1."""
    return get_op_threads() if _fused_loops_on_all["prefill" if has_prefill else "decode"] else 1


def compiled_step_threads(has_prefill: bool) -> contextlib.AbstractContextManager[None]:
    """Run a compiled step's call with ``fused_loop_threads(has_prefill)`` as torch's count (the
    opaque ops inside still set ``op_threads()`` themselves); put the count back after."""
    return _torch_threads(fused_loop_threads(has_prefill))

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
- an eager step and the sampler run whole inside ``op_threads()``.

``op_threads()`` sets torch's count for the block and puts it back after (0.14 µs a call).
vLLM has no counterpart (its CPU worker keeps one OpenMP thread per core).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_op_threads: int | None = None


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
def op_threads() -> Iterator[None]:
    """Run the block with ``set_op_threads``'s count as torch's thread count."""
    wanted = _op_threads
    if wanted is None:
        yield
        return
    saved = torch.get_num_threads()
    if saved == wanted:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(saved)

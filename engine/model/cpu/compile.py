"""The model's forward through ``torch.compile``: one graph for every batch, cached on disk.

Mirrors what vLLM's ``vllm/compilation/`` does for its ``@support_torch_compile`` models,
in its CPU build's shape: Dynamo traces the whole forward once, Inductor fuses the small
operations between the matrix multiplies (RMSNorm, RoPE, SiLU·mul, residual adds) into C++
loops (Triton kernels on a GPU), and the result serves every batch size.

What makes one graph enough:

- **Attention is one opaque op.** Each layer calls ``glassbox::attention`` (defined here,
  vLLM: ``unified_attention``) with its layer index (``engine/model/attention.py``); the op
  reads the step's metadata (how many decodes, each request's start — plain ints) from the
  forward context (``engine/model/forward_context.py``), so none of it is traced into guards.
- **The token dimension is unbacked** (``mark_unbacked``): Dynamo may not specialise on the
  number of tokens, not even on 1 (a step with one decode reuses the graph; a plain dynamic
  dimension would be re-specialised for size 1 and compile a second graph mid-run).
- **Only the inputs are guarded.** Dynamo checks, before each call, what the graph assumed;
  on the model itself (1,600-odd checks: every parameter, every attribute read) that is
  time with nothing to find, so only the inputs' guards are kept (vLLM keeps none).
- **Linears keep oneDNN's packed weights** through ``glassbox::onednn_linear``
  (``engine/model/cpu/linear.py``): Inductor's own oneDNN lowering wants the weights frozen into
  the graph, which would rule out the on-disk cache.

The compiled code is cached by Inductor under ``<GLASSBOX_CACHE_ROOT>/torch_compile_cache``
(``TORCHINDUCTOR_CACHE_DIR`` when set): the first start compiles (seconds to tens of
seconds on a CPU), later starts of the same model and settings load it.

``--enforce-eager`` (or ``GLASSBOX_TORCH_COMPILE=0``) keeps the plain eager forward, the
readable reference the compiled one is tested against.

``CompiledModel`` sets Inductor's options for the whole process (``cpp.threads``,
``backed_size_oblivious``, the cache directory): in a worker process that is only Glassbox's
compile; with ``GLASSBOX_ENABLE_MULTIPROCESSING=0`` they reach your own ``torch.compile``
calls in the same process too.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine import envs
from engine.logger import init_logger
from engine.model.cpu.op_threads import op_threads
from engine.model.forward_context import get_forward_context
from engine.model.utils import IntermediateTensors

logger = init_logger(__name__)


@torch.library.custom_op("glassbox::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    """The attention of layer ``layer_index`` as one op of the compiled graph (vLLM:
    ``unified_attention``): ``Attention.forward`` run eagerly with the forward context's
    metadata and cache. It writes the new K/V into the cache, which the graph does not see
    (the cache is not one of its tensors). Returns ``(num_tokens, num_heads * head_dim)``."""
    ctx = get_forward_context()
    kv_cache = ctx.kv_caches[layer_index] if ctx.kv_caches else None
    with op_threads():  # the worker's thread count of the moment (engine/model/cpu/op_threads.py)
        return ctx.layers[layer_index](q, k, v, kv_cache, ctx.attn_metadata)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def compile_cache_dir() -> Path:
    """Where Inductor keeps compiled graphs: ``$TORCHINDUCTOR_CACHE_DIR`` when the user set
    it, else ``<GLASSBOX_CACHE_ROOT>/torch_compile_cache`` (vLLM:
    ``~/.cache/vllm/torch_compile_cache``). Importing Inductor's config fills the variable in
    with torch's default (``/tmp/torchinductor_<user>``, gone at reboot): that value counts
    as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and chosen not in (default_cache_dir(), _set_by_us):
        return Path(chosen)
    return Path(envs.GLASSBOX_CACHE_ROOT).expanduser() / "torch_compile_cache"


_set_by_us: str | None = None  # what use_compile_cache_dir last put in the variable


def use_compile_cache_dir() -> Path:
    """Point Inductor at ``compile_cache_dir()`` for this process (it reads the variable at
    each compile) and return it."""
    global _set_by_us
    path = compile_cache_dir()
    _set_by_us = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def missing_cxx_compiler(device: torch.device) -> str | None:
    """Why Inductor cannot compile for ``device`` here, or None when it can.

    Inductor's CPU kernels are C++ compiled at run time, so a CPU needs ``$CXX``, ``g++`` or
    ``clang++`` on PATH (a GPU gets Triton kernels instead).
    """
    import shutil

    if device.type != "cpu":
        return None
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++"]
    if any(shutil.which(c) for c in compilers):
        return None
    return f"no C++ compiler ({', '.join(compilers)}) on PATH"


def _input_guards_only(guards: list) -> list[bool]:
    """``guard_filter_fn`` keeping the guards on the forward's arguments (``input_ids``,
    ``positions``, ``intermediate_tensors``: their dtype, rank, None or not) and none on the
    model itself (its parameters, its modules' attributes, the globals it reads) or on the
    global state."""
    return [re.split(r"[.\[]", g.name, maxsplit=1)[0] in _GUARDED_INPUTS for g in guards]


# The forward's arguments whose guards stay (a guard's name starts with the local it checks).
_GUARDED_INPUTS = frozenset({"input_ids", "positions", "intermediate_tensors"})


class CompiledModel:
    """``model``'s forward through ``torch.compile`` (Inductor), counting its graphs.

    ``__call__(input_ids (T,), positions (T,), intermediate_tensors)`` returns what the
    model's forward returns; call it inside ``set_forward_context`` (the attention op reads
    its metadata and caches there). ``num_graphs``: graphs compiled so far (1 once warm);
    ``compile_s``: seconds of the calls that made them (Dynamo's tracing, Inductor's compile
    or its cache load, and that one forward). After ``seal()`` (end of warm-up), a new graph
    is logged as a warning and counted in ``graphs_after_warm_up``: it means a guard failed
    and a request paid seconds of compile (the worker reports the count in its status file,
    ``glassbox ps``, so a test or a user can see it; 0 on a healthy server). ``cache``: where
    the graphs came from, read from torch's own counters (AOTAutograd's and Inductor's cache
    hits and misses): ``"hit"`` (a warm start), ``"miss"`` (a cold one), ``"mixed"``.
    """

    def __init__(self, model: nn.Module) -> None:
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        self.cache_dir = use_compile_cache_dir()
        # Sizes are not specialised on 0 or 1 when a guard can be avoided (a batch of one).
        fx_config.backed_size_oblivious = True
        # Every engine of this process compiles its own model: one more cache entry on the
        # same forward code object each time. Dynamo's default limit (8) made the 9th engine
        # of a process (a notebook, a script comparing settings) fail with "recompile limit
        # exceeded"; graphs of one engine are still counted and reported (seal()).
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
        inductor_config.fx_graph_cache = True
        # Inductor's own kernels (the fused norms, RoPE, SiLU·mul, adds) read the thread count
        # when they run (OpenMP's dynamic count), not a count fixed in the C++: the worker runs
        # them on all of the step's threads or on one, whichever it measured faster for decode
        # steps and for prefill steps (engine/model/cpu/op_threads.py, compiled_step_threads).
        # They once ran on one thread always: with OMP_WAIT_POLICY=PASSIVE (then the workers'
        # default) every parallel region put the team to sleep and woke it again; with the short
        # spin of today's default (GOMP_SPINCOUNT) both threads won at most shapes on the AMX
        # Xeon (docs/performance.md, "The compiled step"). The graph is made for this process's
        # thread count (the compile cache keys on it); a worker of one thread keeps plain loops.
        threads = torch.get_num_threads()
        inductor_config.cpp.threads = threads
        inductor_config.cpp.dynamic_threads = threads > 1
        self.model = model
        self.num_graphs = 0
        self.compile_s = 0.0
        self.graphs_after_warm_up = 0
        self._sealed = False
        self._cache_hits = self._cache_misses = 0
        # Guards on the inputs only (vLLM drops them all: ``TorchCompileGuardsStripWrapper``):
        # the one graph serves every step of this model, so the 1,600-odd checks Dynamo would
        # run before each call on the model itself (every parameter's shape and dtype, every
        # module attribute read, the global state) only cost time — 0.34 ms a step on the
        # "small" model, measured. The inputs' few stay: an input of another dtype or rank
        # still makes (and counts) a graph of its own. With no guard on the model, two models of
        # one process must not share graphs: Dynamo keeps them per code object (every model's
        # ``forward``) but looks up only those made by an equal backend, and each
        # CompiledModel's backend is its own bound method (``_backend``), so another model's
        # graph is never this one's.
        self._forward = torch.compile(model, backend=self._backend, fullgraph=True,
                                      options={"guard_filter_fn": _input_guards_only})  # fmt: skip

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.num_graphs += 1
        if self._sealed:
            self.graphs_after_warm_up += 1
            logger.warning("torch.compile is making graph #%d after warm-up (a guard failed): this "
                           "step pays the compile", self.num_graphs)  # fmt: skip
        from torch._dynamo.utils import counters

        def looked_up() -> tuple[int, int]:
            aot, ind = counters["aot_autograd"], counters["inductor"]
            return (aot["autograd_cache_hit"] + ind["fxgraph_cache_hit"],
                    aot["autograd_cache_miss"] + ind["fxgraph_cache_miss"])  # fmt: skip

        (hits, misses), compiled = looked_up(), compile_fx(gm, example_inputs)
        hits_after, misses_after = looked_up()
        self._cache_hits += hits_after - hits
        self._cache_misses += misses_after - misses
        return compiled

    @property
    def cache(self) -> str:
        """``"hit"``, ``"miss"`` or ``"mixed"``: where this model's graphs came from (class doc)."""
        if self._cache_misses == 0:
            return "hit" if self._cache_hits else "miss"
        return "mixed" if self._cache_hits else "miss"

    def seal(self) -> None:
        """Warm-up is over: any later graph is unexpected (logged)."""
        self._sealed = True

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        if intermediate_tensors is not None:
            for tensor in intermediate_tensors.tensors.values():
                torch._dynamo.decorators.mark_unbacked(tensor, 0)
        graphs, start = self.num_graphs, time.perf_counter()
        out = self._forward(input_ids, positions, None, None, intermediate_tensors)
        if self.num_graphs != graphs:  # this call traced and compiled (or loaded) a graph
            self.compile_s += time.perf_counter() - start
        return out

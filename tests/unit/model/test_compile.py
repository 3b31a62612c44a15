"""The compiled forward (``engine/model/cpu/compile.py``) as a process sees it: graphs made after
warm-up are counted (what ``glassbox ps`` shows and the parallel-shapes tests check is 0), and
a process may build many engines, each with its own model, without hitting Dynamo's limit."""

from __future__ import annotations

import torch

from engine.model.cpu.compile import CompiledModel
from tracing.instances import runs_as_text


class Doubler(torch.nn.Module):
    """The call shape of a model's forward, with nothing inside."""

    def forward(self, input_ids, positions, kv_caches, meta, intermediate_tensors):
        return input_ids * 3


def test_a_graph_made_after_warm_up_is_counted():
    """``CompiledModel`` counts graphs made after ``seal()`` (a failed guard: each cost a step
    seconds of compile) — the count a worker puts in its status file (test_parallel_shapes.py
    checks it is absent); ``glassbox ps`` shows it in the compile text."""
    compiled = CompiledModel(Doubler())
    ids = torch.arange(5)
    assert compiled(ids, ids).tolist() == [0, 3, 6, 9, 12]
    compiled.seal()
    assert (compiled.num_graphs, compiled.graphs_after_warm_up) == (1, 0)
    half = torch.arange(3, dtype=torch.float32)  # a dtype the graph was not made for: a guard fails
    assert compiled(half, half).tolist() == [0.0, 3.0, 6.0]
    assert (compiled.num_graphs, compiled.graphs_after_warm_up) == (2, 1)
    runs_as = {"device": "cpu", "compile": "compiled (inductor, 2 graphs, 1 after warm-up)",
               "graphs_after_warm_up": "1"}  # fmt: skip
    assert runs_as_text(runs_as) == "cpu, compiled (inductor, 2 graphs, 1 after warm-up)"


def test_a_process_builds_more_engines_than_dynamos_default_recompile_limit():
    """Each engine compiles its own model instance, a new entry on the same code object:
    Dynamo's default limit (8) made the 9th ``LLM(...)`` of one process fail with "recompile
    limit exceeded" (a notebook, a script comparing settings; the test suite found it)."""
    ids = torch.arange(4)
    for n in range(12):
        compiled = CompiledModel(Doubler())
        assert compiled(ids, ids).tolist() == [0, 3, 6, 9], n
        assert compiled.num_graphs == 1


class Scaler(torch.nn.Module):
    """Multiplies by the sum of its ``size`` ones: ``size`` itself."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.ones = torch.nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, input_ids, positions, kv_caches, meta, intermediate_tensors):
        return input_ids * self.ones.sum()


def test_models_of_one_process_each_run_their_own_graph():
    """The compiled forward keeps no guard on the model (its parameters' shapes go unchecked at
    each call), so each ``CompiledModel`` keeps its own graphs: a second model of another shape
    in the same process (``GLASSBOX_ENABLE_MULTIPROCESSING=0``, a notebook) must not run the
    first one's graph — it would multiply by 2 where it should by 5."""
    ids = torch.arange(4, dtype=torch.float32)
    two, five = CompiledModel(Scaler(2)), CompiledModel(Scaler(5))
    assert two(ids, ids).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert five(ids, ids).tolist() == [0.0, 5.0, 10.0, 15.0]
    assert two(ids, ids).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert (two.num_graphs, five.num_graphs) == (1, 1)


def test_a_cold_start_compiles_and_a_warm_one_loads_from_the_cache(tmp_path, monkeypatch):
    """The first compile in an empty cache directory is a miss (compiled, then written); the
    next model of the same code, as the next server start, loads its graph: a hit. The
    worker's log line and its warm-up span say which (``glassbox.compile.cache``)."""
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()  # as a new process: no graph held in memory
    ids = torch.arange(6)
    cold = CompiledModel(Doubler())
    assert str(cold.cache_dir).startswith(str(tmp_path))
    assert cold(ids, ids).tolist() == [0, 3, 6, 9, 12, 15]
    assert cold.cache == "miss"
    torch._dynamo.reset()
    warm = CompiledModel(Doubler())
    assert warm(ids, ids).tolist() == [0, 3, 6, 9, 12, 15]
    assert warm.cache == "hit"


class Norm(torch.nn.Module):
    """An RMSNorm over rows, SiLU after: a fused loop with a reduction, as the models' norms."""

    def forward(self, input_ids, positions, kv_caches, meta, intermediate_tensors):
        x = input_ids
        return torch.nn.functional.silu(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_the_compiled_loops_give_the_eager_numbers_on_one_thread_and_on_all():
    """A compiled graph's loops read the thread count when they run (OpenMP's dynamic count,
    when the process has several threads): the same graph on one thread and on two gives the
    eager numbers, and changing the count makes no second graph."""
    from engine.model.cpu import op_threads

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = CompiledModel(Norm())
        x = torch.randn(300, 512)
        expected = Norm()(x, None, None, None, None)
        for decode_all in (True, False, True):
            op_threads.set_fused_loop_threads(decode_all, decode_all)
            with op_threads.compiled_step_threads(has_prefill=False):
                torch.testing.assert_close(model(x, x), expected)
        assert model.num_graphs == 1
    finally:
        op_threads.set_fused_loop_threads(True, True)
        torch.set_num_threads(saved)


def test_a_worker_of_one_thread_reads_in_the_singular():
    """``glassbox ps`` said "1 CPU threads" of a DP worker (a fresh user's read of -dp 2)."""
    assert runs_as_text({"device": "cpu", "cpu_threads": "1"}) == "cpu, 1 CPU thread"
    assert runs_as_text({"device": "cpu", "cpu_threads": "1 of 2"}) == "cpu, 1 of 2 CPU threads"
    assert (
        runs_as_text({"fused_loop_threads": "all threads (measured)"})
        == "fused loops on all threads (measured)"
    )


def test_runs_as_names_the_pages_the_kv_cache_lies_on_after_the_threads():
    runs_as = {"device": "cpu", "dtype": "bfloat16", "cpu_threads": "2 of 2", "kv_cache_pages": "2 MiB pages"}
    assert runs_as_text(runs_as) == "cpu bfloat16, 2 of 2 CPU threads, KV cache on 2 MiB pages"

"""Pipeline parallelism: ``-pp 2`` and ``-tp 2 -pp 2`` give the pp = 1 (and transformers') tokens.

The fast tests check vLLM's partition rule (and ``GLASSBOX_PP_LAYER_PARTITION`` with its bad
values), the start-up refusals in the first process, and — in this process, with a stand-in
PP group — that each stage builds and reads only its own layers and that the stages chained
by hand compute the whole model's logits. The slow ones run the real tree: the offline
``LLM`` → ``EngineCore_DP0`` → ``Worker_DP0_PP<p>_TP<t>``, hidden states passed from stage to
stage over gloo each step.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch
from proc_utils import titled_processes, wait_gone
from tiny_models import hf_greedy

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.distributed.utils import get_pp_indices, get_pp_partition
from engine.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (3, 20, 41)]
ENV = "GLASSBOX_PP_LAYER_PARTITION"


@pytest.fixture(scope="module")
def tiny_dir(tiny_dir):
    """conftest's builder, with 4 layers (2 per stage)."""
    return functools.partial(tiny_dir, num_layers=4)


# ----------------------------------------------------------------------------- fast


@pytest.mark.parametrize(
    "num_layers, pp, partition",
    [
        (4, 1, [4]),
        (4, 2, [2, 2]),
        (3, 2, [2, 1]),  # the remainder goes before the last stage (it also runs the LM head)
        (4, 3, [1, 2, 1]),
        (5, 3, [2, 2, 1]),
        (10, 4, [2, 3, 3, 2]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_default_partition_follows_vllm(monkeypatch, num_layers, pp, partition):
    monkeypatch.delenv(ENV, raising=False)
    assert get_pp_partition(num_layers, pp) == partition
    bounds = [get_pp_indices(num_layers, r, pp) for r in range(pp)]
    assert [end - start for start, end in bounds] == partition
    assert bounds[0][0] == 0 and bounds[-1][1] == num_layers
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(pp - 1))


def test_partition_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "3,1")
    assert [get_pp_indices(4, r, 2) for r in range(2)] == [(0, 3), (3, 4)]
    monkeypatch.setenv(ENV, "4,6,6,4")
    assert [get_pp_indices(20, r, 4) for r in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]


@pytest.mark.parametrize(
    "value, match",
    [
        ("2,2,", "comma-separated layer counts"),
        ("2,a", "comma-separated layer counts"),
        ("0,4", "comma-separated layer counts"),
        ("-1,5", "comma-separated layer counts"),
        ("1,1,2", "has 3 stage"),
        ("2,3", "sums to 5 layers"),
    ],
)
def test_bad_partition_values_are_refused(monkeypatch, tiny_dir, value, match):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=match):
        get_pp_partition(4, 2)
    args = EngineArgs(model=str(tiny_dir("llama")), max_model_len=64, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match=match) as err:  # in the first process, before any spawn
        args.create_engine_config()
    assert err.value.flag == ENV
    assert "\n" not in str(err.value) and str(err.value).startswith(ENV)


def test_pp_size_above_the_layers_is_a_one_line_config_error(tiny_dir):
    args = EngineArgs(model=str(tiny_dir("llama")), max_model_len=64, pipeline_parallel_size=5)
    with pytest.raises(ConfigError, match=r"must not exceed num_hidden_layers \(4\)") as err:
        args.create_engine_config()
    assert err.value.flag == "--pipeline-parallel-size"
    assert "\n" not in str(err.value)
    config = EngineArgs(model=str(tiny_dir("llama")), max_model_len=64, pipeline_parallel_size=4)
    assert config.create_engine_config().parallel_config.world_size == 4


def test_uni_backend_with_pp_is_refused_and_dp_is_accepted(tiny_dir, monkeypatch):
    path = str(tiny_dir("llama"))
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2 needs one process per worker") as err:
        EngineArgs(
            model=path, pipeline_parallel_size=2, distributed_executor_backend="uni"
        ).create_engine_config()
    assert err.value.flag == "--distributed-executor-backend"
    # Data parallelism runs (tests/e2e/test_data_parallel.py), in engine core processes only.
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    assert (
        EngineArgs(model=path, data_parallel_size=2).create_engine_config().parallel_config.data_parallel_size
        == 2
    )
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ConfigError) as err:
        EngineArgs(model=path, data_parallel_size=2).create_engine_config()
    assert err.value.flag == "--data-parallel-size"


@pytest.mark.parametrize("arch, partition", [("llama", None), ("qwen2", "3,1")])
def test_each_stage_holds_and_reads_only_its_layers_and_chained_stages_equal_the_model(
    tiny_dir, monkeypatch, arch, partition
):
    """Stage models built in this process (a stand-in PP group), chained by hand."""
    from engine.distributed import parallel_state
    from engine.model import loader
    from engine.model.attention import AttentionMetadata
    from engine.model.utils import IntermediateTensors

    path = tiny_dir(arch)  # llama: tied embeddings; qwen2: untied, q/k/v bias
    model_config = EngineArgs(model=str(path), max_model_len=64).create_engine_config().model_config
    cpu = torch.device("cpu")
    ids = torch.tensor(PROMPTS[1])
    positions = torch.arange(len(ids))
    meta = AttentionMetadata.for_profile([len(ids)], cpu)
    with torch.inference_mode():
        whole = loader.load_model(model_config, cpu, torch.float32)
        expected = whole.compute_logits(whole(ids, positions, meta))
    if partition:
        monkeypatch.setenv(ENV, partition)

    read: list[str] = []
    real_load = loader.LazySlice.load
    monkeypatch.setattr(loader.LazySlice, "load", lambda self: read.append(self._name) or real_load(self))
    bounds = [(0, 2), (2, 4)] if partition is None else [(0, 3), (3, 4)]
    stages = []
    for rank in range(2):
        fake_group = SimpleNamespace(rank_in_group=rank, world_size=2, is_first_rank=rank == 0,
                                     is_last_rank=rank == 1)  # fmt: skip
        monkeypatch.setattr(parallel_state, "_PP", fake_group)
        read.clear()
        stage = loader.load_model(model_config, cpu, torch.float32)
        start, end = bounds[rank]
        assert [layer.self_attn.attn.num_heads for layer in stage.local_layers] == [4] * (end - start)
        layer_ids = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
        assert layer_ids == set(range(start, end)), read
        assert ("model.embed_tokens.weight" in read) == (rank == 0 or arch == "llama")  # tied: last too
        assert ("model.norm.weight" in read) == (rank == 1)
        assert ("lm_head.weight" in read) == (rank == 1 and arch == "qwen2")
        params = dict(stage.named_parameters())
        assert all(int(n.split(".")[2]) in range(start, end) for n in params if n.startswith("model.layers."))
        stages.append(stage)
    monkeypatch.setattr(parallel_state, "_PP", None)

    with torch.inference_mode():
        handed = stages[0](ids, positions, meta)
        assert isinstance(handed, IntermediateTensors) and handed["hidden_states"].shape == (len(ids), 64)
        hidden = stages[1](torch.zeros_like(ids), positions, meta, None, handed)
        torch.testing.assert_close(stages[1].compute_logits(hidden), expected)


def test_scheduler_sends_the_scheduled_tokens_only_with_pp():
    from engine.config import CacheConfig, SchedulerConfig
    from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
    from engine.sched.request import Request
    from engine.sched.scheduler import Scheduler

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype_size=4, num_layers=2)
    for use_pp in (False, True):
        sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=16),
                          KVCacheConfig(num_blocks=32, spec=spec), log_stats=False, use_pp=use_pp)  # fmt: skip
        sched.add_request(Request(request_id="r", prompt_token_ids=[5, 6, 7],
                                  sampling_params=SamplingParams(max_tokens=4), eos_token_id=None))  # fmt: skip
        sched.schedule()
        sched.requests["r"].append_output_token_ids([42])  # as update_from_output does
        cached = sched.schedule().scheduled_cached_reqs
        assert cached.req_ids == ["r"]
        assert cached.new_token_ids == ([[42]] if use_pp else [])


# ----------------------------------------------------------------------------- slow


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_and_tp2_pp2_greedy_equal_transformers_through_titled_workers(
    tiny_dir, monkeypatch, reap_children
):
    path = tiny_dir("llama", num_heads=4, num_kv_heads=2)  # GQA, tied embeddings
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")  # pp = 1, in this process
    with LLM(str(path), max_model_len=128) as llm:
        assert _generate(llm) == expected
        seeded_pp1 = _generate(llm, SEEDED)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    for tp, pp in ((1, 2), (2, 2)):
        with LLM(str(path), max_model_len=128, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
            tree = titled_processes(os.getpid())
            names = [f"glassbox::Worker_DP0_PP{p}_TP{t}" for p in range(pp) for t in range(tp)]
            assert sorted(tree) == sorted(["glassbox::EngineCore_DP0", *names])
            core = tree["glassbox::EngineCore_DP0"]
            assert all(tree[n].ppid() == core.pid for n in names)
            assert _generate(llm) == expected, (tp, pp)
            assert _generate(llm, SEEDED) == seeded_pp1, (tp, pp)
            pids = [p.pid for p in tree.values()]
            run_dir = llm.run_dir
        assert wait_gone(pids) == []
        assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pp2_qwen2_with_an_uneven_layer_partition(tiny_dir, monkeypatch, reap_children):
    """Untied LM head on the last stage, q/k/v bias, 3 layers on stage 0 and 1 on stage 1; the
    engine core sizes the cache by the stage with more layers."""
    path = tiny_dir("qwen2", num_heads=4, num_kv_heads=2)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv(ENV, "3,1")
    budget = 4 << 20
    with LLM(str(path), max_model_len=128, pipeline_parallel_size=2, kv_cache_memory_bytes=budget) as llm:
        assert _generate(llm) == expected
        page = 2 * 16 * 2 * 16 * 4  # K and V, block 16, 2 KV heads of 16, float32
        assert llm.engine_core.call_utility("get_kv_cache_info")["num_blocks"] == budget // (page * 3)

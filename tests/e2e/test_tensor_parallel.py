"""Tensor parallelism: ``-tp 2`` gives the tp = 1 (and transformers') tokens, as 3 titled processes.

The fast tests check what is decided before any process starts (a TP size that does not
split the heads, ``uni`` with TP, the rendezvous deadline naming the absent rank, each
rank reading only its slice of a checkpoint tensor). The slow ones run the real tree:
the offline ``LLM`` → ``EngineCore_DP0`` → ``Worker_DP0_PP0_TP0`` and ``_TP1`` joined by a
gloo process group, for two GQA architectures, and SIGKILL of one TP worker mid-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from proc_utils import generate_killing_on_first_finish, titled_processes, wait_gone
from tiny_models import hf_greedy

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (3, 20, 41)]


# ----------------------------------------------------------------------------- fast


@pytest.mark.parametrize(
    "heads, kv_heads, tp, reason",
    [(4, 2, 3, "attention heads"), (12, 4, 3, "KV heads"), (4, 4, 2, None), (8, 2, 4, None), (8, 2, 8, None)],
)
def test_tp_size_is_checked_against_the_heads_in_the_first_process(tiny_dir, heads, kv_heads, tp, reason):
    path = tiny_dir("llama", num_heads=heads, num_kv_heads=kv_heads, hidden_size=96 if heads == 12 else 64,
                    intermediate_size=96)  # fmt: skip
    args = EngineArgs(model=str(path), max_model_len=64, tensor_parallel_size=tp)
    if reason is None:
        assert args.create_engine_config().parallel_config.tensor_parallel_size == tp
        return
    with pytest.raises(ConfigError, match=reason) as err:
        args.create_engine_config()
    assert err.value.flag == "--tensor-parallel-size"


def test_uni_backend_with_tp_is_refused(tiny_dir):
    path = tiny_dir("llama")
    args = EngineArgs(model=str(path), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="needs one process per worker") as err:
        args.create_engine_config()
    assert err.value.flag == "--distributed-executor-backend"


def test_dist_init_timeout_is_validated(monkeypatch):
    from engine import envs

    monkeypatch.setenv("GLASSBOX_DIST_INIT_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="GLASSBOX_DIST_INIT_TIMEOUT_S"):
        _ = envs.GLASSBOX_DIST_INIT_TIMEOUT_S
    monkeypatch.setenv("GLASSBOX_DIST_INIT_TIMEOUT_S", "2.5")
    assert envs.GLASSBOX_DIST_INIT_TIMEOUT_S == 2.5


def test_rendezvous_deadline_names_the_ranks_that_never_arrived():
    from engine.distributed import parallel_state

    method = parallel_state.get_distributed_init_method()
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) 1 \(W1\), 2 \(W2\) of 3 never arrived within 0.5 s"
    ) as err:
        parallel_state._rendezvous(method, 0, 3, timeout_s=0.5, rank_name=lambda r: f"W{r}")
    assert err.value.missing_ranks == [1, 2]
    assert time.monotonic() - start < 5
    assert parallel_state.get_tensor_model_parallel_world_size() == 1  # no group was left behind


def test_each_rank_reads_only_its_slice(tmp_path):
    from safetensors.torch import save_file

    from engine.model.layers import MergedColumnParallelLinear, RowParallelLinear
    from engine.model.loader import LazySlice, iterate_safetensors

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    save_file({"w": full}, str(tmp_path / "m.safetensors"))
    (name, lazy), *_ = list(iterate_safetensors(tmp_path, lazy=True))
    assert isinstance(lazy, LazySlice) and lazy.shape == full.shape
    assert torch.equal(lazy.narrow(0, 4, 4).narrow(1, 3, 3).load(), full[4:8, 3:6])
    for rank in range(2):
        row = RowParallelLinear(6, 8, tp_rank=rank, tp_size=2)
        row.weight_loader(row.weight, lazy)
        assert torch.equal(row.weight.data, full[:, rank * 3 : rank * 3 + 3])
        merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=rank, tp_size=2)
        merged.weight_loader(merged.weight, lazy, 0)
        merged.weight_loader(merged.weight, full, 1)
        assert torch.equal(merged.weight.data, torch.cat([full[rank * 4 : rank * 4 + 4]] * 2))


# ----------------------------------------------------------------------------- slow


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# Every rank samples from the same all-gathered logits with the same seeded generators; a rank
# that drew a different token would feed it back next step and the text would drift from tp = 1.
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_greedy_equals_transformers_through_three_titled_processes(tiny_dir, arch, monkeypatch,
                                                                        reap_children):  # fmt: skip
    # GQA: 4 query heads over 2 KV heads, so each rank holds 2 query heads and 1 KV head.
    path = tiny_dir(arch, num_heads=4, num_kv_heads=2)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")  # tp = 1, in this process
    with LLM(str(path), max_model_len=128) as llm:
        assert _generate(llm) == expected
        seeded_tp1 = _generate(llm, SEEDED)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(path), max_model_len=128, tensor_parallel_size=2) as llm:
        tree = titled_processes(os.getpid())
        assert sorted(tree) == ["glassbox::EngineCore_DP0", "glassbox::Worker_DP0_PP0_TP0",
                                "glassbox::Worker_DP0_PP0_TP1"]  # fmt: skip
        core = tree["glassbox::EngineCore_DP0"]
        workers = [tree[f"glassbox::Worker_DP0_PP0_TP{t}"] for t in (0, 1)]
        assert all(w.ppid() == core.pid for w in workers)
        got = _generate(llm)
        seeded = _generate(llm, SEEDED)
        if arch == "llama":
            ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json"], capture_output=True,
                                text=True, timeout=60)  # fmt: skip
            assert ps.returncode == 0, ps.stderr
            mine = [i for i in json.loads(ps.stdout)["instances"] if i["run_dir"] == str(llm.run_dir)]
            assert len(mine) == 1
            assert mine[0]["expected_process_count"] == 3 and mine[0]["found_process_count"] == 3
            assert mine[0]["missing"] == []
        run_dir = llm.run_dir
    assert got == expected
    assert seeded == seeded_tp1
    assert wait_gone([core.pid, *(w.pid for w in workers)]) == []
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tp_without_multiprocessing_keeps_the_engine_here_and_the_workers_in_processes(tiny_dir, monkeypatch,
                                                                                        reap_children):  # fmt: skip
    # As vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the caller's
    # process, but tensor parallelism still needs one process per worker.
    path = tiny_dir("qwen2", num_heads=4, num_kv_heads=2)
    expected = hf_greedy(path, PROMPTS[1], GREEDY.max_tokens)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with LLM(str(path), max_model_len=128, tensor_parallel_size=2) as llm:
        assert llm.config.parallel_config.distributed_executor_backend == "mp"
        tree = titled_processes(os.getpid())
        assert sorted(tree) == ["glassbox::Worker_DP0_PP0_TP0", "glassbox::Worker_DP0_PP0_TP1"]
        assert all(w.ppid() == os.getpid() for w in tree.values())
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == expected
    assert wait_gone([w.pid for w in tree.values()]) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_of_one_tp_worker_names_it_as_the_root_cause(tiny_dir, monkeypatch, reap_children):
    path = tiny_dir("llama", num_heads=4, num_kv_heads=2)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(path), max_model_len=512, tensor_parallel_size=2)
    try:
        tree = titled_processes(os.getpid())
        core = tree["glassbox::EngineCore_DP0"]
        workers = [tree[f"glassbox::Worker_DP0_PP0_TP{t}"] for t in (0, 1)]
        error, elapsed = generate_killing_on_first_finish(llm, workers[1].pid)
        assert elapsed < 10
        assert "Worker_DP0_PP0_TP1" in error.root_cause
        assert "SIGKILL" in error.root_cause
        assert wait_gone([core.pid, *(w.pid for w in workers)]) == []
    finally:
        llm.shutdown()
    assert not llm.run_dir.exists()

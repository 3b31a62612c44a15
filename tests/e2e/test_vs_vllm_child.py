"""benchmarks/vs_vllm.py's child script under an engine that starts processes with spawn.

vLLM starts its engine core with multiprocessing's spawn, which imports the parent's main
script again in the new process: a child script with its work at module level ran it a
second time there and failed ("An attempt has been made to start a new process before the
current process has finished its bootstrapping phase"), so ``--vllm-python`` gave no result.
vLLM itself cannot be installed in the test environment (its CPU build pins its own torch
and dozens of packages); the stand-in below does what matters here, starting a spawned
process inside ``LLM(...)``, and returns greedy-shaped outputs of the asked lengths.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STAND_IN = """
import multiprocessing
from types import SimpleNamespace

__version__ = "0.0-stand-in"


def _engine_core(queue):
    queue.put("ready")


class SamplingParams:
    def __init__(self, max_tokens, **kwargs):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, **kwargs):
        ctx = multiprocessing.get_context("spawn")  # as vLLM's engine core
        queue = ctx.Queue()
        proc = ctx.Process(target=_engine_core, args=(queue,))
        proc.start()
        assert queue.get(timeout=60) == "ready"
        proc.join(timeout=60)

    def generate(self, prompts, params, use_tqdm=False):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(p.max_tokens)))]) for p in params]
"""


def _load_vs_vllm():
    spec = importlib.util.spec_from_file_location("vs_vllm", REPO / "benchmarks" / "vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_child_runs_an_engine_that_spawns(tmp_path: Path) -> None:
    vs_vllm = _load_vs_vllm()
    (tmp_path / "pkgs" / "vllm").mkdir(parents=True)
    (tmp_path / "pkgs" / "vllm" / "__init__.py").write_text(STAND_IN)
    work = tmp_path / "work"
    work.mkdir()
    (work / "child.py").write_text(vs_vllm.CHILD)
    engine = vs_vllm.Engine("vllm", "stand-in", sys.executable, {}, {"PYTHONPATH": str(tmp_path / "pkgs")})
    common = {"model": "unused", "max_model_len": 64, "prompts": [[1, 2, 3], [4, 5]], "out_lens": [3, 5]}

    result = vs_vllm.run_child(engine, "float32", "t", work, common, timeout=90)

    assert result["engine"] == "vllm"
    assert result["version"] == "0.0-stand-in"
    assert result["output_tokens"] == 8
    assert [len(t) for t in result["tokens"]] == [3, 5]

"""Bad input gets one clear error naming the field, from the API (ValueError) and the CLI (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.engine_args import EngineArgs

GLASSBOX = [sys.executable, "-m", "engine.cli.main"]


def _cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*GLASSBOX, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"max_model_len": 10**6}, "--max-model-len"),
        ({"block_size": 7}, "--block-size"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"scheduling_policy": "lifo"}, "--scheduling-policy"),
        ({"dtype": "int3"}, "--dtype"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
        ({"num_gpu_blocks_override": 1}, "--num-gpu-blocks-override"),
        ({"model": "/nonexistent/model"}, "--model"),
        ({"structured_outputs_config": {"backend": "xgrammar"}}, "--structured-outputs-config"),
        ({"structured_outputs_config": {"bakend": "guidance"}}, "--structured-outputs-config"),
        ({"structured_outputs_config": {"disable_any_whitespace": "yes"}}, "--structured-outputs-config"),
    ],
)
def test_config_error_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        EngineArgs(**kwargs).create_engine_config()
    assert err.value.flag == flag
    assert str(err.value).startswith(flag)


def test_structured_outputs_config_takes_vllms_keys():
    config = EngineArgs(
        structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True}
    ).create_engine_config()
    assert config.structured_outputs_config.backend == "guidance"
    assert config.structured_outputs_config.disable_any_whitespace is True
    assert EngineArgs().create_engine_config().structured_outputs_config.backend == "auto"


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))


def test_kv_budget_too_small_for_one_request(default_model_dir):
    with pytest.raises(ValueError, match="max-model-len"):
        LLM(kv_cache_memory_bytes=100_000)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"n": 10**20}, "n"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field)


def test_prompt_longer_than_max_model_len_is_rejected_and_queues_nothing():
    with LLM(max_model_len=32) as llm:
        with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
            llm.generate(["ok", {"prompt_token_ids": list(range(5, 45))}], SamplingParams(max_tokens=2))
        assert not llm.output_processor.has_unfinished_requests()
        # The engine still works afterwards.
        assert llm.generate("ok", SamplingParams(max_tokens=2))[0].finished


def test_config_is_validated_without_torch():
    code = (
        "import sys; from engine.engine_args import EngineArgs; from engine.sampling_params import SamplingParams;"
        "import engine.config; EngineArgs().create_engine_config(); SamplingParams(temperature=0);"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_generate_prints_text():
    proc = _cli("generate", "Once upon a time", "--max-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Once upon a time" in proc.stdout
    assert "finish_reason=" in proc.stdout


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--block-size", "7"], "--block-size"),
        (["--max-model-len", "1000000"], "--max-model-len"),
        (["--model", "/nonexistent/x"], "--model"),
        (["--temperature", "-1"], "--temperature"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--kv-cache-memory-bytes", "1000"], "--kv-cache-memory-bytes"),
        (["--tokenizer", "/tmp"], "--tokenizer"),
        (["--override-generation-config", '{"temprature": 0.5}'], "--override-generation-config"),
    ],
)
def test_cli_bad_value_exits_2_naming_the_flag(args, flag):
    proc = _cli("generate", "hi", *args)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(rf"glassbox generate: error: (argument )?{flag}\b", last), last
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flag, example",
    [
        ("--pooler-config", '{"pooling_type": "MEAN"}'),
        ("--override-generation-config", '{"temperature": 0.5}'),
        ("--structured-outputs-config", '{"backend": "guidance"}'),
    ],
)
@pytest.mark.parametrize("value", ["{bad", "[1]"])
def test_a_json_flags_error_gives_an_example_of_that_flag(flag, example, value, capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(prog="glassbox serve"), serving=True)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([flag, value])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (exit_.value.code, last.startswith(f"glassbox serve: error: argument {flag}: ")) == (2, True), last
    assert last.endswith(f"e.g. '{example}'"), last


def test_model_dir_without_weights_is_refused_before_anything_starts(tmp_path, default_model_dir):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    proc = _cli("generate", "hi", "--model", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"glassbox generate: error: --model: invalid value {str(tmp_path)!r} "
        "(the directory has no *.safetensors weights) (see glassbox generate --help)"
    )


@pytest.mark.parametrize(
    "var, value",
    [
        ("GLASSBOX_LOGGING_LEVEL", "bogus"),
        ("GLASSBOX_CPU_KVCACHE_SPACE", "abc"),
        ("GLASSBOX_MQ_TIMEOUT_S", "-1"),
    ],
)
@pytest.mark.parametrize("command", [["ps"], ["generate", "hi"]])
def test_bad_environment_variable_is_one_line_exit_2_before_anything_starts(var, value, command):
    proc = _cli(*command, env={var: value})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"error: {var}={value!r} is not valid" in proc.stderr


def test_cli_help_reads_well():
    top = _cli("--help")
    assert top.returncode == 0 and "generate" in top.stdout
    assert "engine-top" in top.stdout  # the live view is its own command: say where it is
    sub = _cli("generate", "--help")
    assert sub.returncode == 0
    for flag in ("--max-num-batched-tokens", "--enable-prefix-caching", "--tensor-parallel-size", "-tp"):
        assert flag in sub.stdout


def test_configuration_reference_is_current():
    from pathlib import Path

    from engine.config_reference import render_markdown

    committed = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    assert committed == render_markdown(), "run: python -m engine.config_reference > docs/configuration.md"

"""vLLM's flags and defaults: what a vLLM user types works, or is refused naming the flag.

- ``--generation-config``: requests' unset sampling params come from the model's
  ``generation_config.json`` as in vLLM (its sampling fields only; ``do_sample`` ignored),
  ``vllm`` ignores the file, a directory replaces it.
- ``--max-logprobs``, ``--chat-template``, ``--enable-log-requests``, ``--trust-remote-code``.
- vLLM flags Glassbox leaves out are refused with one line naming them (exit 2); a few that
  change nothing are accepted with a note.
- ``--help`` shows every option's default; ``engine/cli/torch_info.py`` says which torch.

Most checks are in-process (the parser, ``ModelConfig``, the OpenAI serving classes over a
fake engine); one real ``glassbox serve`` checks the flags end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest

from engine.config import DEFAULT_MODEL, ConfigError
from engine.engine_args import IGNORED_VLLM_FLAGS, REFUSED_VLLM_FLAGS, EngineArgs
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
GLASSBOX = [sys.executable, "-m", "engine.cli.main"]


def _model_dir_with(tmp_path: Path, generation_config: dict | None) -> Path:
    """The bundled model's files (linked), with our own generation_config.json (or none)."""
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(DEFAULT_MODEL).iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f.resolve())
    if generation_config is not None:
        (model / "generation_config.json").write_text(json.dumps(generation_config))
    return model


def _gen_dir(tmp_path: Path, values: dict, name: str = "gen") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(values))
    return d


def _model_config(**kwargs):
    return EngineArgs(**kwargs).create_engine_config().model_config


# ---------------------------------------------------------------------------- --generation-config


def test_do_sample_false_is_ignored(tmp_path):
    """vLLM ignores do_sample: a model whose file says do_sample: false still samples."""
    model = _model_dir_with(tmp_path, {"do_sample": False, "eos_token_id": [0, 2]})
    mc = _model_config(model=str(model))
    assert mc.get_diff_sampling_param() == {}
    params = SamplingParams.from_defaults(mc.get_diff_sampling_param())
    assert params.temperature == 1.0 and not params.sampling_type_greedy
    # The bundled model's file (do_sample: false when this was written) gives no greedy default either.
    bundled = _model_config().get_diff_sampling_param()
    assert "do_sample" not in bundled
    assert SamplingParams.from_defaults(bundled).temperature == bundled.get("temperature", 1.0)


def test_auto_takes_only_the_sampling_fields(tmp_path):
    model = _model_dir_with(
        tmp_path,
        {"do_sample": False, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 12, "num_beams": 4, "eos_token_id": [0, 2]},
    )  # fmt: skip
    diff = _model_config(model=str(model)).get_diff_sampling_param()
    assert diff == {
        "repetition_penalty": 1.1,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "max_tokens": 12,
    }
    params = SamplingParams.from_defaults(diff)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 12)


def test_vllm_ignores_the_file_but_keeps_its_eos_ids(tmp_path):
    model = _model_dir_with(tmp_path, {"temperature": 0.3, "top_k": 5, "eos_token_id": [0, 2, 7]})
    mc = _model_config(model=str(model), generation_config="vllm")
    assert mc.get_diff_sampling_param() == {}
    assert mc.generation_config["eos_token_id"] == [0, 2, 7]  # still stops on every EOS
    over = _model_config(
        model=str(model), generation_config="vllm", override_generation_config={"top_p": 0.5}
    )
    assert over.get_diff_sampling_param() == {"top_p": 0.5}


def test_a_directory_replaces_the_models_file(tmp_path):
    gen = _gen_dir(tmp_path, {"temperature": 0.3, "top_k": 5, "do_sample": False})
    diff = _model_config(generation_config=str(gen)).get_diff_sampling_param()
    assert diff == {"temperature": 0.3, "top_k": 5}


@pytest.mark.parametrize(
    "make_value, flag, words",
    [
        (lambda p: str(p / "missing"), "--generation-config", "directory"),
        (lambda p: str(p), "--generation-config", "no generation_config.json"),
        (lambda p: str(_gen_dir(p, {"temperature": -1})), "--generation-config", "temperature"),
        (lambda p: 42, "--generation-config", "auto, vllm"),
    ],
)
def test_bad_generation_config_names_the_flag(tmp_path, make_value, flag, words):
    with pytest.raises(ConfigError) as err:
        _model_config(generation_config=make_value(tmp_path))
    assert err.value.flag == flag and words in str(err.value)


def test_bad_generation_config_json(tmp_path):
    d = tmp_path / "gen"
    d.mkdir()
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^--generation-config: .*bad generation_config.json"):
        _model_config(generation_config=str(d))


def test_bad_override_names_its_flag():
    with pytest.raises(ConfigError) as err:
        _model_config(override_generation_config={"top_p": 7})
    assert err.value.flag == "--override-generation-config"


def test_defaults_are_logged_once(tmp_path):
    gen = _gen_dir(tmp_path, {"temperature": 0.3, "top_k": 5})
    code = (
        "from engine.engine_args import EngineArgs;"
        f"mc = EngineArgs(generation_config={str(gen)!r}).create_engine_config().model_config;"
        "mc.get_diff_sampling_param(); mc.get_diff_sampling_param()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "Default sampling params" in line]
    assert len(lines) == 1 and "temperature=0.3, top_k=5" in lines[0], proc.stderr


# ---------------------------------------------------------------------------- the OpenAI server's params


class _Captured(Exception):
    def __init__(self, params: list[SamplingParams]) -> None:
        self.params = params


def _fake_engine(model_config):
    """Just enough of ``AsyncLLM`` for the serving classes; ``generate`` records the params."""
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.input_processor import InputProcessor
    from engine.frontend.tokenizer import get_tokenizer

    seen: list[SamplingParams] = []
    tokenizer = get_tokenizer(model_config.tokenizer)
    engine = types.SimpleNamespace(model_config=model_config, tokenizer=tokenizer, dead_error=None, seen=seen,
                                   input_processor=InputProcessor(model_config, tokenizer))  # fmt: skip
    engine.get_default_sampling_params = lambda: AsyncLLM.get_default_sampling_params(engine)

    async def generate(prompt, params, request_id, **kwargs):
        seen.append(params)
        raise _Captured(seen)
        yield  # an async generator, as AsyncLLM.generate is

    engine.generate = generate
    return engine


def _server_params(model_config, route: str, body: dict) -> SamplingParams:
    """The ``SamplingParams`` the server builds for ``body`` (route: "chat" or "completion")."""
    from engine.entrypoints.openai import protocol
    from engine.entrypoints.openai.serving_chat import OpenAIServingChat
    from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion

    engine = _fake_engine(model_config)
    if route == "chat":
        serving, call = OpenAIServingChat(engine, "m"), "create_chat_completion"
        request = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **body)
    else:
        serving, call = OpenAIServingCompletion(engine, "m"), "create_completion"
        request = protocol.CompletionRequest(prompt="Once upon a time", **body)
    with pytest.raises(_Captured):
        asyncio.run(getattr(serving, call)(request))
    return engine.seen[0]


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_server_samples_with_n_and_no_temperature(tmp_path, route):
    """A model whose file says do_sample: false (the bundled one did): an n=4 request is
    sampled, not silently greedy."""
    model = _model_dir_with(tmp_path, {"do_sample": False, "eos_token_id": [0, 2]})
    params = _server_params(_model_config(model=str(model)), route, {"n": 4, "max_tokens": 8, "top_p": 0.9})
    assert params.n == 4 and params.temperature == 1.0 and params.top_p == 0.9
    assert not params.sampling_type_greedy
    bundled = _server_params(_model_config(), route, {"n": 4, "max_tokens": 8})
    assert bundled.temperature == _model_config().get_diff_sampling_param().get("temperature", 1.0)


def test_server_takes_the_generation_config_defaults(tmp_path):
    gen = _gen_dir(tmp_path, {"temperature": 0.3, "top_k": 5, "max_new_tokens": 7, "do_sample": False})
    mc = _model_config(generation_config=str(gen))
    params = _server_params(mc, "chat", {})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 5, 7)
    # The request's own values win; max_new_tokens caps max_tokens, as in vLLM.
    params = _server_params(mc, "completion", {"temperature": 0.9, "top_k": 50, "max_tokens": 100})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 50, 7)
    # --generation-config vllm: vLLM's own defaults.
    model = _model_dir_with(tmp_path, {"temperature": 0.3, "top_k": 5})
    params = _server_params(_model_config(model=str(model), generation_config="vllm"), "chat", {})
    assert (params.temperature, params.top_k) == (1.0, 0)


def test_offline_defaults_sample_and_differ(tmp_path):
    """``LLM``'s default params with do_sample: false in the file: ``n`` samples differ."""
    from engine import LLM

    model = _model_dir_with(tmp_path, {"do_sample": False, "eos_token_id": [0, 2]})
    with LLM(str(model), max_model_len=128, num_gpu_blocks_override=64) as llm:
        assert llm.get_default_sampling_params().temperature == 1.0
        defaults = llm.config.model_config.get_diff_sampling_param()
        out = llm.generate(
            "The engine", SamplingParams.from_defaults(defaults, n=8, max_tokens=16), use_tqdm=False
        )
        samples = [tuple(c.token_ids) for c in out[0].outputs]
        assert len(samples) == 8 and len(set(samples)) > 1, samples


# ---------------------------------------------------------------------------- --max-logprobs


def test_max_logprobs_comes_from_the_config():
    from engine.frontend.input_processor import InputProcessor
    from engine.frontend.tokenizer import get_tokenizer

    SamplingParams(logprobs=50)  # no fixed limit in SamplingParams itself
    mc = _model_config(max_logprobs=5)
    processor = InputProcessor(mc, get_tokenizer(mc.tokenizer))
    processor.process_inputs("a", "hello", SamplingParams(logprobs=5, prompt_logprobs=5))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError) as err:
            processor.process_inputs("b", "hello", SamplingParams(**{field: 6}))
        assert str(err.value).startswith(f"{field} must be between 0 and 5")
    unlimited = InputProcessor(_model_config(max_logprobs=-1), processor.tokenizer)
    unlimited.process_inputs("c", "hello", SamplingParams(logprobs=mc.vocab_size))
    with pytest.raises(ConfigError, match="^--max-logprobs"):
        _model_config(max_logprobs=-2)


def test_server_refuses_more_logprobs_than_max_logprobs():
    from engine.entrypoints.openai.serving_engine import OpenAIError

    mc = _model_config(max_logprobs=3)
    for route, body, param in [
        ("completion", {"logprobs": 4}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    ]:
        with pytest.raises(OpenAIError) as err:
            _server_params(mc, route, body)
        assert err.value.param == param and err.value.status_code == 400 and "3" in err.value.message
    assert _server_params(_model_config(max_logprobs=30), "completion", {"logprobs": 25}).logprobs == 25


# ---------------------------------------------------------------------------- --chat-template


def test_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages[0]['content'] }}")
    assert _model_config(chat_template=str(f)).chat_template == "FILE {{ messages[0]['content'] }}"
    inline = _model_config(chat_template="A{{ messages[0]['content'] }}\\nB").chat_template
    assert inline == "A{{ messages[0]['content'] }}\nB"  # escapes decoded, as vLLM does


@pytest.mark.parametrize("value", ["/no/such/template.jinja", "{% if %}", "{{ unclosed"])
def test_bad_chat_template_names_the_flag(value):
    with pytest.raises(ConfigError) as err:
        _model_config(chat_template=value)
    assert err.value.flag == "--chat-template"


def test_llm_chat_uses_the_chat_template():
    from engine import LLM

    template = "<<{% for m in messages %}{{ m['content'] }}{% endfor %}>>"
    with LLM(max_model_len=64, num_gpu_blocks_override=16, chat_template=template) as llm:
        out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out[0].prompt == "<<Hi>>"
        # An explicit chat_template= still wins.
        out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False,
                       chat_template="[{{ messages[0]['content'] }}]")  # fmt: skip
        assert out[0].prompt == "[Hi]"


# ---------------------------------------------------------------------------- flags on the CLI


def _serve_parser():
    from engine.config_reference import serve_parser

    return serve_parser()


def _parse_error(capsys, *argv: str) -> str:
    from engine.cli.main import _make_parser

    with pytest.raises(SystemExit) as exit_info:
        _make_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flag", REFUSED_VLLM_FLAGS, ids=lambda f: f.names[0])
def test_refused_vllm_flags_name_the_flag(capsys, flag):
    argv = [flag.names[0], "x"] if flag.takes_value else [flag.names[0]]
    err = _parse_error(capsys, *argv)
    assert flag.names[0] in err and "Glassbox does not support" in err and "unrecognized" not in err


@pytest.mark.parametrize(
    "argv",
    [["-q", "awq"], ["--quantization=awq"], ["--swap-space", "4"], ["--kv-transfer-config"],
     ["--task", "embed"]],
)  # fmt: skip
def test_refused_flag_spellings(capsys, argv):
    err = _parse_error(capsys, *argv)
    assert "Glassbox does not support" in err


def test_harmless_values_of_refused_flags_are_accepted():
    from engine.cli.main import _make_parser

    args = _make_parser().parse_args(
        ["serve", "--api-server-count", "2", "--runner", "generate", "--task", "auto"]
    )
    assert args.command == "serve" and args.api_server_count == 2


def test_api_server_count_below_one_names_the_flag(capsys):
    err = _parse_error(capsys, "--api-server-count", "0")
    assert "--api-server-count" in err and "must be an integer >= 1, got '0'" in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode"),
        (["--max-logprobs", "-3"], "--max-logprobs"),
        (["--chat-template", "/no/such.jinja"], "--chat-template"),
        (["--generation-config", "/no/such/dir"], "--generation-config"),
        (["--max-log-len", "-1"], "--max-log-len"),
        (["--step-delay-ms", "-5"], "--step-delay-ms"),
        (["--step-delay-ms", "nan"], "--step-delay-ms"),
        (["--telemetry-record", "/no/such/dir/rec.bin"], "--telemetry-record"),
        (["--telemetry-record", "/tmp"], "--telemetry-record"),
    ],
)
def test_unsupported_values_name_the_flag(argv, flag):
    args = _serve_parser().parse_args(argv)
    with pytest.raises(ConfigError) as err:
        EngineArgs.from_cli_args(args).create_engine_config(usage_context="serve")
    assert err.value.flag == flag and str(err.value).startswith(flag)


def test_accepted_flags_parse_and_reach_the_config():
    argv = ["--trust-remote-code", "--max-logprobs", "7", "--generation-config", "vllm", "--enable-log-requests",
            "--max-log-len", "40", "--kv-cache-dtype", "auto", "--tokenizer-mode", "hf",
            "--override-generation-config", '{"temperature": 0.5}']  # fmt: skip
    for flag in IGNORED_VLLM_FLAGS:
        argv += [flag.names[0], "x"] if flag.takes_value else [flag.names[0]]
    config = EngineArgs.from_cli_args(_serve_parser().parse_args(argv)).create_engine_config("serve")
    mc, obs = config.model_config, config.observability_config
    assert (mc.max_logprobs, mc.generation_config_source, mc.trust_remote_code) == (7, "vllm", True)
    assert mc.get_diff_sampling_param() == {"temperature": 0.5}
    assert obs.enable_log_requests and obs.max_log_len == 40
    args = _serve_parser().parse_args(["--enable-log-requests", "--disable-log-requests"])
    assert args.enable_log_requests is False


def test_llm_keywords_follow_the_same_rules():
    from engine import LLM
    from engine.engine_args import drop_vllm_compat_kwargs

    with pytest.raises(ConfigError) as err:
        LLM(quantization="awq")
    assert err.value.flag == "--quantization" and "Glassbox does not support" in str(err.value)
    kept = drop_vllm_compat_kwargs(
        {"download_dir": "/x", "task": "generate", "disable_log_stats": True, "seed": 3}
    )
    assert kept == {"seed": 3}


def test_ignored_flags_and_trust_remote_code_log_a_note():
    proc = subprocess.run(
        [*GLASSBOX, "serve", "--download-dir", "/tmp/x", "--trust-remote-code", "--swap-space", "4"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--download-dir is accepted for vLLM compatibility and ignored" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("glassbox serve: error: --swap-space 4:")
    note = subprocess.run(
        [sys.executable, "-c", "from engine import EngineArgs; EngineArgs(trust_remote_code=True).create_engine_config()"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert note.returncode == 0 and "never runs code from a model directory" in note.stderr


# ---------------------------------------------------------------------------- --help shows defaults


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    from engine.cli.main import _make_parser

    top = _make_parser()
    choices = top._subparsers._group_actions[0].choices
    parsers = {name: p for name, p in choices.items()}
    bench = choices["bench"]
    for name, p in bench._subparsers._group_actions[0].choices.items():
        parsers[f"bench {name}"] = p
    return parsers


def test_every_option_with_a_default_shows_it_in_help():
    missing = []
    for name, parser in _subcommand_parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (
                not action.option_strings
                or action.help is argparse.SUPPRESS
                or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            ):
                continue
            text = formatter._expand_help(action)
            if "default" not in text.lower():
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
    help_text = _subcommand_parsers()["serve"].format_help()
    assert "(default: 8000)" in help_text and "(default: 20)" in help_text  # --port, --max-logprobs
    assert "--quantization" not in help_text  # refused flags stay out of --help


# ---------------------------------------------------------------------------- torch_info and make


def test_torch_info_is_one_quick_line_without_torch():
    code = "import sys; from engine.cli import torch_info; print(torch_info.describe()); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    line, imported = proc.stdout.strip().splitlines()
    assert line.startswith("glassbox: torch ") and "build)" in line and "GPU" in line, line
    assert imported == "False"
    script = subprocess.run([sys.executable, "engine/cli/torch_info.py"], capture_output=True, text=True,
                            timeout=30, cwd=ROOT)  # fmt: skip
    assert script.returncode == 0 and script.stdout.strip() == line


def test_torch_info_names_the_gpu(tmp_path, monkeypatch):
    from engine.cli import torch_info

    gpu = tmp_path / "0000:00:05.0"
    gpu.mkdir()
    (gpu / "information").write_text("Model: \t\t NVIDIA H200\nIRQ: 42\n")
    monkeypatch.setattr(torch_info, "DRIVER_GPUS", tmp_path)
    assert torch_info.nvidia_gpus() == ["NVIDIA H200"]
    monkeypatch.setattr(torch_info, "torch_build", lambda: ("2.13.0+cpu", "CPU build"))
    assert "NVIDIA GPU found: NVIDIA H200 (this torch cannot use it" in torch_info.describe()
    monkeypatch.setattr(torch_info, "torch_build", lambda: ("2.13.0", "CUDA 13.0 build"))
    assert torch_info.describe() == "glassbox: torch 2.13.0 (CUDA 13.0 build), NVIDIA GPU found: NVIDIA H200"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_announces_each_setup_step(tmp_path):
    proc = subprocess.run(["make", "-n", "run", f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)  # fmt: skip
    out = proc.stdout
    for step in ("[1/3] creating the virtualenv", "[2/3] installing torch==", "[3/3] installing glassbox"):
        assert step in out, out
    assert "engine/cli/torch_info.py" in out and "glassbox serve" in out


# ---------------------------------------------------------------------------- end to end


@pytest.mark.timeout(240)
def test_serve_with_vllm_flags(tmp_path):
    """A real server: --chat-template renders chats, --max-logprobs caps, requests are logged,
    the generation config's defaults are named in the start-up log."""
    from server_utils import start_server

    from engine.frontend.tokenizer import get_tokenizer

    gen = _gen_dir(tmp_path, {"temperature": 0.3, "top_k": 5})
    server = start_server(
        tmp_path / "run",
        "--max-model-len", "128", "--num-gpu-blocks-override", "32", "--chat-template",
        "<<{% for m in messages %}{{ m['content'] }}{% endfor %}>>", "--max-logprobs", "3",
        "--enable-log-requests", "--max-log-len", "10", "--generation-config", str(gen),
        "--trust-remote-code", "--disable-log-stats",
    )  # fmt: skip
    try:
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2})  # fmt: skip
        assert chat.status_code == 200, chat.text
        expected = get_tokenizer(DEFAULT_MODEL).encode("<<Hi there>>", add_special_tokens=False)
        assert chat.json()["usage"]["prompt_tokens"] == len(expected)
        bad = httpx.post(server.base_url + "/v1/completions", timeout=60,
                         json={"prompt": "Hello", "max_tokens": 2, "logprobs": 4})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs", bad.text
        ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                        json={"prompt": "Hello", "max_tokens": 2, "logprobs": 3})  # fmt: skip
        assert ok.status_code == 200, ok.text
        log = server.log()
        assert "Default sampling params taken from --generation-config's generation_config.json: " \
               "temperature=0.3, top_k=5" in log, log[-3000:]  # fmt: skip
        assert "never runs code from a model directory" in log
        received = [line for line in log.splitlines() if "Received request" in line]
        assert len(received) >= 2, log[-3000:]
        assert any("chatcmpl-" in line and "'<<Hi there'" in line for line in received), received
        assert all('"temperature":0.3' in line for line in received), received
    finally:
        server.kill_group()

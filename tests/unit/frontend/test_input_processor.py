"""InputProcessor validation, tokenizer loading, chat templates, and the no-torch rule."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from frontend_fixtures import BOS_ID, EOS_ID, VOCAB_SIZE, build_model_dir, build_tokenizer_dir

from engine.config import ModelConfig
from engine.frontend.input_processor import InputProcessor
from engine.frontend.tokenizer import apply_chat_template, get_tokenizer
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("model"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def processor(model_dir):
    return InputProcessor(ModelConfig(model=str(model_dir)), get_tokenizer(str(model_dir)))


def test_text_prompt_is_tokenized_with_bos(processor):
    req = processor.process_inputs(
        "a", "Hello world", SamplingParams(max_tokens=4), arrival_time=12.5, priority=3
    )
    ids = processor.tokenizer.encode("Hello world", add_special_tokens=False)
    assert req.prompt_token_ids == [BOS_ID, *ids]
    assert (req.request_id, req.arrival_time, req.priority, req.eos_token_id) == ("a", 12.5, 3, EOS_ID)
    assert (
        processor.process_inputs("b", {"prompt": "Hello world"}, SamplingParams()).prompt_token_ids
        == req.prompt_token_ids
    )
    plain = processor.process_inputs(
        "c", "Hello world", SamplingParams(), tokenization_kwargs={"add_special_tokens": False}
    )
    assert plain.prompt_token_ids == ids


def test_tokens_prompt_used_as_is(processor):
    req = processor.process_inputs("a", {"prompt_token_ids": [7, 8, 9]}, SamplingParams())
    assert req.prompt_token_ids == [7, 8, 9]


def test_data_parallel_rank_must_name_an_engine(model_dir):
    proc = InputProcessor(
        ModelConfig(model=str(model_dir)), get_tokenizer(str(model_dir)), data_parallel_size=2
    )
    prompt = {"prompt_token_ids": [7]}
    req = proc.process_inputs("a", prompt, SamplingParams(), data_parallel_rank=1)
    assert req.data_parallel_rank == 1
    for rank in (2, -1):
        with pytest.raises(ValueError, match=f"data_parallel_rank {rank} is out of range"):
            proc.process_inputs("b", prompt, SamplingParams(), data_parallel_rank=rank)


@pytest.mark.parametrize(
    "prompt", [{"prompt_token_ids": []}, ""], ids=["no-token-ids", "empty-text-without-special-tokens"]
)
def test_empty_prompt_rejected(processor, prompt):
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        processor.process_inputs(
            "a", prompt, SamplingParams(), tokenization_kwargs={"add_special_tokens": False}
        )


@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1, 10**9])
def test_out_of_vocabulary_token_id_rejected(processor, bad):
    with pytest.raises(ValueError, match=rf"Token id {bad} is out of vocabulary \(vocab_size={VOCAB_SIZE}\)"):
        processor.process_inputs("a", {"prompt_token_ids": [5, bad, 6]}, SamplingParams())


def test_malformed_prompt_rejected(processor):
    with pytest.raises(ValueError, match="a prompt must be"):
        processor.process_inputs("a", 42, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be integers"):
        processor.process_inputs("a", {"prompt_token_ids": ["x"]}, SamplingParams())


def test_a_prompt_must_leave_room_for_one_output_token(processor):
    # vLLM's rule, the API server's too: a prompt of max_model_len tokens has no room left.
    for n in (MAX_MODEL_LEN, MAX_MODEL_LEN + 1):
        with pytest.raises(ValueError) as err:
            processor.process_inputs("a", {"prompt_token_ids": [5] * n}, SamplingParams())
        assert str(err.value) == (
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request "
            f"has {n} input tokens, which leaves no room for output. Please reduce the length of "
            "the input prompt."
        )
    req = processor.process_inputs(
        "b", {"prompt_token_ids": [5] * (MAX_MODEL_LEN - 1)}, SamplingParams(max_tokens=None)
    )
    assert req.sampling_params.max_tokens == 1


def test_max_tokens_default_and_params_not_mutated(processor):
    params = SamplingParams(max_tokens=None, stop=["x"], stop_token_ids=[9])
    before = msgspec.to_builtins(params)
    req = processor.process_inputs("a", {"prompt_token_ids": [5] * 10}, params)
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    assert msgspec.to_builtins(params) == before
    assert req.sampling_params is not params and params.max_tokens is None
    explicit = processor.process_inputs("b", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=3))
    assert explicit.sampling_params.max_tokens == 3


def test_request_survives_the_wire(processor):
    req = processor.process_inputs("a", "Hello", SamplingParams(max_tokens=None, n=2, seed=1))
    from engine.core.messages import EngineCoreRequest

    again = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert again == req


def test_generation_config_extra_eos_merged(tmp_path):
    model_dir = build_model_dir(tmp_path, generation_config={"eos_token_id": [EOS_ID, 7, 8]})
    proc = InputProcessor(ModelConfig(model=str(model_dir)), get_tokenizer(str(model_dir)))
    params = SamplingParams(stop_token_ids=[9])
    req = proc.process_inputs("a", "Hello", params)
    assert req.eos_token_id == EOS_ID
    assert sorted(req.sampling_params.all_stop_token_ids) == [7, 8, 9]
    assert params.all_stop_token_ids == [9], "the caller's params keep their own list"
    ignoring = proc.process_inputs("b", "Hello", SamplingParams(ignore_eos=True))
    assert ignoring.sampling_params.all_stop_token_ids == []


def test_config_eos_stops_when_tokenizer_eos_differs(tmp_path):
    # No generation_config.json, and config.json names another EOS than the tokenizer
    # (chat checkpoints often do): both stop generation, the tokenizer's is the primary.
    model_dir = build_model_dir(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    proc = InputProcessor(ModelConfig(model=str(model_dir)), get_tokenizer(str(model_dir)))
    req = proc.process_inputs("a", "Hello", SamplingParams())
    assert req.eos_token_id == EOS_ID
    assert req.sampling_params.all_stop_token_ids == [2]


def test_stop_strings_need_detokenize(processor):
    with pytest.raises(ValueError, match="detokenize"):
        processor.process_inputs("a", "Hello", SamplingParams(stop=["x"], detokenize=False))


@pytest.mark.parametrize("bad", [VOCAB_SIZE, VOCAB_SIZE + 1000])
def test_out_of_vocabulary_stop_token_id_rejected(processor, bad):
    # The message starts with the field's name: the API server names it in ``param``.
    with pytest.raises(
        ValueError, match=rf"^stop_token_ids holds token id {bad}, which is out of vocabulary"
    ):
        processor.process_inputs("a", "Hello", SamplingParams(stop_token_ids=[3, bad]))


def test_stop_string_that_is_not_unicode_rejected(processor):
    # A lone surrogate (JSON can carry one) could not cross to the engine core as UTF-8.
    with pytest.raises(ValueError, match=r"^stop strings must be valid Unicode text"):
        processor.process_inputs("a", "Hello", SamplingParams(stop=["ok", "x\ud800"]))


def test_tokenizer_length_limit_is_the_engines(tmp_path):
    # A checkpoint's model_max_length would only make transformers warn, for each long
    # prompt, that it "will result in indexing errors": lengths are ours to check.
    tok_dir = build_tokenizer_dir(tmp_path)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 16}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        tokenizer = get_tokenizer(str(tok_dir))
        assert len(tokenizer.encode("Hello world " * 50)) > 16
    finally:
        transformers_logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


def test_get_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        get_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"no tokenizer.json in '{tmp_path}'"):
        get_tokenizer(str(tmp_path))


def test_chat_template(tmp_path):
    tokenizer = get_tokenizer(str(build_tokenizer_dir(tmp_path / "with")))
    messages = [{"role": "user", "content": "Hi"}]
    assert apply_chat_template(tokenizer, messages) == "<s>user: Hi\nassistant:"
    assert apply_chat_template(tokenizer, messages, add_generation_prompt=False) == "<s>user: Hi\n"
    assert apply_chat_template(tokenizer, messages, chat_template="[{{ messages[0]['content'] }}]") == "[Hi]"
    refusing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(tokenizer, messages, chat_template=refusing)

    bare = get_tokenizer(str(build_tokenizer_dir(tmp_path / "without", chat_template=None)))
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(bare, messages)


def test_frontend_never_imports_torch(tmp_path):
    # A fresh interpreter: load a tokenizer, render a chat, process a request and its output.
    model_dir = build_model_dir(tmp_path)
    code = f"""
import sys
from engine.config import ModelConfig
from engine.core.messages import EngineCoreOutput
from engine.frontend import detokenizer, input_processor, output_processor, outputs, tokenizer
from engine.sampling_params import SamplingParams
tok = tokenizer.get_tokenizer({str(model_dir)!r})
text = tokenizer.apply_chat_template(tok, [{{"role": "user", "content": "Hi"}}])
proc = input_processor.InputProcessor(ModelConfig(model={str(model_dir)!r}), tok)
req = proc.process_inputs("r", text, SamplingParams(logprobs=1))
out = output_processor.OutputProcessor(tok)
out.add_request(req, text)
out.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[5])])
heavy = sorted(m for m in sys.modules if m.partition(".")[0] == "torch" or m.startswith(("engine.model", "engine.worker")))
print("HEAVY", heavy)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout

"""``--runner pooling``, ``--convert``, ``--pooler-config`` and ``PoolingParams``: the defaults
vLLM 0.32 picks, and one clear error naming the flag (or the request field) otherwise."""

from __future__ import annotations

import json

import pytest
from test_config_and_cli import _cli

from engine.config import ConfigError
from engine.engine_args import EngineArgs
from engine.pooling_params import PoolingParams


def _config(**kwargs):
    return EngineArgs(**kwargs).create_engine_config()


def test_generate_is_the_default_runner():
    config = _config()
    assert (config.model_config.runner_type, config.model_config.convert_type) == ("generate", "none")
    assert config.model_config.pooler_config is None
    assert config.model_config.supported_tasks == ("generate",)


@pytest.mark.parametrize("kwargs", [{"runner": "pooling"}, {"convert": "embed"}])
def test_pooling_defaults_are_vllms_for_a_converted_decoder(kwargs):
    config = _config(**kwargs)
    model = config.model_config
    assert (model.runner_type, model.convert_type, model.supported_tasks) == ("pooling", "embed", ("embed",))
    assert model.pooler_config.seq_pooling_type == "LAST"
    # LAST pooling reads the last chunk's last token: chunked prefill and prefix caching stay on.
    assert config.scheduler_config.enable_chunked_prefill and config.cache_config.enable_prefix_caching


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_take_each_prompt_whole(pooling_type):
    config = _config(runner="pooling", pooler_config={"pooling_type": pooling_type}, max_model_len=2048,
                     max_num_batched_tokens=None)  # fmt: skip
    assert not config.scheduler_config.enable_chunked_prefill
    assert not config.cache_config.enable_prefix_caching
    assert config.scheduler_config.max_num_batched_tokens >= 2048  # one whole prompt fits a step


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"runner": "draft"}, "--runner"),
        ({"convert": "classify"}, "--convert"),
        ({"runner": "generate", "convert": "embed"}, "--convert"),
        ({"runner": "pooling", "convert": "none"}, "--convert"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "--pooler-config"),  # a generate runner
        ({"runner": "pooling", "pooler_config": {"normalize": False}}, "--pooler-config"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "ALL"}}, "--pooler-config"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "LAST", "seq_pooling_type": "LAST"}},
         "--pooler-config"),
        ({"runner": "pooling", "pooler_config": {"enable_chunked_processing": True}}, "--pooler-config"),
        ({"runner": "pooling", "pooler_config": {"pooling_typ": "MEAN"}}, "--pooler-config"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}, "enable_chunked_prefill": True},
         "--enable-chunked-prefill"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "CLS"}, "enable_prefix_caching": True},
         "--enable-prefix-caching"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}, "long_prefill_token_threshold": 8},
         "--long-prefill-token-threshold"),
    ],
)  # fmt: skip
def test_bad_pooling_setting_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        _config(**kwargs)
    assert err.value.flag == flag and str(err.value).startswith(flag)


def test_removed_normalize_gets_vllms_message():
    with pytest.raises(ConfigError, match="`normalize` was removed; use `use_activation` instead"):
        _config(runner="pooling", pooler_config={"normalize": True})


def test_cli_refuses_chunked_prefill_under_mean_pooling_in_one_line():
    proc = _cli("generate", "hi", "--runner", "pooling", "--pooler-config", json.dumps({"pooling_type": "MEAN"}),
                "--enable-chunked-prefill")  # fmt: skip
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "glassbox generate: error: --enable-chunked-prefill: invalid value True (MEAN pooling needs every "
            "prompt token computed in one step"
        )
    )
    assert "Traceback" not in proc.stderr


def test_cli_generate_refuses_a_pooling_runner_before_starting_an_engine():
    proc = _cli("generate", "hi", "--runner", "pooling")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("glassbox generate: error: --runner pooling: glassbox generate generates text")
    )


# ------------------------------------------------------------------------------ PoolingParams


def _pooling_model(tmp_path, default_model_dir, **config_overrides):
    """The bundled model's files, with ``config_overrides`` in its config.json."""
    for path in default_model_dir.iterdir():
        if path.is_file():
            (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **config_overrides}))
    return _config(model=str(tmp_path), runner="pooling").model_config


def test_verify_fills_in_the_pooler_configs_defaults():
    model = _config(runner="pooling", pooler_config={"use_activation": False}).model_config
    params = PoolingParams()
    params.verify(model)
    assert (params.task, params.use_activation, params.dimensions) == ("embed", False, None)
    own = PoolingParams(use_activation=True)
    own.verify(model)
    assert own.use_activation is True, "a request's own value wins"
    default = PoolingParams()
    default.verify(_config(runner="pooling").model_config)
    assert default.use_activation is True, "normalised unless asked otherwise (vLLM's default)"


def test_dimensions_is_refused_unless_the_model_is_matryoshka(tmp_path, default_model_dir):
    plain = _config(runner="pooling").model_config
    with pytest.raises(ValueError, match="^dimensions is not supported: .*does not support Matryoshka"):
        PoolingParams(dimensions=8).verify(plain)

    matryoshka = _pooling_model(tmp_path, default_model_dir, matryoshka_dimensions=[32, 64])
    params = PoolingParams(dimensions=32)
    params.verify(matryoshka)
    assert params.dimensions == 32
    with pytest.raises(ValueError, match=r"^dimensions must be one of \[32, 64\]"):
        PoolingParams(dimensions=48).verify(matryoshka)
    with pytest.raises(ValueError, match=r"^dimensions must be in \[1, "):
        PoolingParams(dimensions=10**6).verify(matryoshka)


def test_a_pooling_task_the_model_does_not_serve_is_refused():
    with pytest.raises(ValueError, match="^task 'embed' is not supported by this model"):
        PoolingParams().verify(_config().model_config)  # a generate runner

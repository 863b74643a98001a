"""The one definition of a reply's settings: SamplingParams, config.toml and stored sessions agree with it."""

from __future__ import annotations

import dataclasses

import pytest

from llama_chat.app.chat.settings import (
    REPLY_MAX_TOKENS,
    SAMPLING,
    SettingError,
    checked,
    max_tokens,
    model_sampling,
    sampling_defaults,
    sampling_params,
    template_variables,
)
from llama_chat.app.config import ConfigError, UserConfig
from llama_chat.inference import Model, SamplingParams
from llama_chat.inference.catalog import KNOWN_MODELS, model_path, recommended_sampling
from llama_chat.inference.weights import prepare
from tiny_models import write_tiny_model


def test_the_sampling_settings_are_sampling_params_fields_with_their_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert {s.key: s.default for s in SAMPLING} == {k: fields[k] for k in (s.key for s in SAMPLING)}
    assert sampling_params({}) == SamplingParams()


def test_every_value_a_setting_allows_makes_a_reply():
    """No value that passes a flag, the config file or the settings screen fails later, in the reply."""
    for setting in SAMPLING:
        edges = [setting.low, setting.high, 0.5, 7]
        for value in [e for e in edges if e is not None]:
            try:
                allowed = setting.check(value if setting.kind is float else int(value))
            except SettingError:
                continue
            assert getattr(sampling_params({setting.key: allowed}), setting.key) == allowed


def test_stored_settings_make_the_sampling_and_the_longest_reply():
    stored = {"temperature": 0.0, "seed": None, "max_tokens": 7}
    params = sampling_params(stored)
    assert (params.temperature, params.seed, params.top_k) == (0.0, None, SamplingParams().top_k)
    assert max_tokens(stored) == 7 and max_tokens({}) == REPLY_MAX_TOKENS.default


def test_checked_refuses_unknown_keys_and_values_out_of_range_in_one_line():
    assert checked({"temperature": 1, "seed": None}) == {"temperature": 1.0, "seed": None}
    with pytest.raises(SettingError, match=r"^unknown setting 'colour' \(known: temperature, top_k"):
        checked({"colour": 1})
    with pytest.raises(SettingError, match=r"^min_p must be between 0 and 1, not nan$"):
        checked({"min_p": float("nan")})
    with pytest.raises(SettingError, match=r"^seed must be an integer, not True$"):
        checked({"seed": True})


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e308, 10**400])
def test_every_number_setting_refuses_what_overflows_the_sampler(value):
    """The sampler works in float32: infinities, NaN and finite values past its range are refused."""
    for setting in (s for s in SAMPLING if s.kind is float):
        with pytest.raises(SettingError, match=rf"^{setting.key} must be (between|more than) "):
            setting.check(value)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[sampling]\ntop_p = 3\n", "[sampling] top_p must be between 0 and 1, not 3.0"),
        ("[sampling]\ncolour = 1\n", "[sampling] unknown setting 'colour'"),
        ("[sampling]\ntop_k = 2.5\n", "[sampling] top_k must be an integer, not 2.5"),
        ("max_tokens = 0\n", "max_tokens must be 1 or more, not 0"),
    ],
)
def test_a_bad_setting_in_config_toml_names_the_file_and_the_setting(tmp_path, text, complaint):
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        UserConfig.load(path)
    assert str(error.value).startswith(f"{path}: {complaint}")


def test_config_toml_sampling_is_read_as_the_settings_types(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("max_tokens = 64\n[sampling]\ntemperature = 1\nseed = 5\n", encoding="utf-8")
    config = UserConfig.load(path)
    assert config.sampling == {"temperature": 1.0, "seed": 5} and config.max_tokens == 64
    assert sampling_params(config.sampling).temperature == 1.0


# -- the defaults a model brings -----------------------------------------------------------------------


def test_a_model_file_recommending_sampling_sets_the_defaults_and_a_session_still_wins(tmp_path):
    keys = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "general.sampling.top_p": 3.0}
    path = write_tiny_model(tmp_path / "recommends.gguf", "qwen2", metadata=keys)
    defaults = model_sampling(Model(prepare(path)))
    assert defaults.source == "recommended in recommends.gguf"
    # 0.7 as a GGUF's float32 is 0.699999988; top-p 3 is no probability: llama.cpp's default stays
    assert (defaults.values["temperature"], defaults.values["top_k"], defaults.values["top_p"]) == (
        0.7,
        20,
        0.95,
    )
    assert sampling_params({}, defaults) == SamplingParams(temperature=0.7, top_k=20)
    stored = {"temperature": 0.0, "top_k": None}  # a config's or the settings screen's
    assert sampling_params(stored, defaults) == SamplingParams(temperature=0.0, top_k=20)


def test_the_catalog_models_sample_as_their_makers_recommend_and_others_as_llama_cpp(qwen2):
    qwen = sampling_defaults(
        *recommended_sampling(model_path(KNOWN_MODELS["qwen2.5-coder-0.5b-instruct-q4_k_m"]), {})
    )
    assert qwen.values | {"seed": None} == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "min_p": 0.0,
        "repeat_penalty": 1.05,
        "seed": None,
    }
    assert qwen.source == "Qwen2.5's model card"
    gemma = sampling_defaults(*recommended_sampling(model_path(KNOWN_MODELS["gemma-3-270m-q4_k_m"]), {}))
    assert (gemma.values["temperature"], gemma.values["top_k"], gemma.values["top_p"]) == (1.0, 64, 0.95)
    plain = model_sampling(Model(prepare(qwen2)))
    assert (plain.values, plain.source) == ({s.key: s.default for s in SAMPLING}, "llama.cpp's defaults")


def test_the_template_switches_are_choices_that_set_the_templates_variables():
    assert template_variables({"thinking": "off", "reasoning_effort": "high", "temperature": 0.2}) == {
        "enable_thinking": False,
        "reasoning_effort": "high",
    }
    assert template_variables({"thinking": None}) == {}  # unset: the template's own default
    with pytest.raises(SettingError, match="thinking must be one of on, off, not 'yes'"):
        checked({"thinking": "yes"})
    with pytest.raises(SettingError, match="reasoning_effort must be one of low, medium, high, not 3"):
        checked({"reasoning_effort": 3})

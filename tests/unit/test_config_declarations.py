"""Config fields declare their choices (``Literal`` types) and ranges (field metadata); validation,
``--set`` parsing and the field list of ``dilocox config --help`` are derived from them.

The CIDs below were recorded from the code before the declarations replaced the hand-written
tuples, range table and if-chains: a configuration's canonical JSON (and so its CID, and the run's
identity) must not move. Fields added since are left out at their defaults; DiLoCoX's default of
``rounds.state_reveal`` ("on_challenge") is not the field's ("upload", what every configuration
written before it meant), so the recorded CIDs are those of the configurations with "upload", and a
configuration of the product's default names the field and has a CID of its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

import trainer.config as config_module
from tests.conftest import small_config
from trainer.config import ConfigError, ModelConfig, RunConfig, SettingError, demo_config, fields_help
from trainer.config_fields import Range, choices_of

RECORDED_CIDS = {
    "default": "bagaaieramt5qbht2jzjfu6kotd7w5y7fdjdbbcmrflli42qnlp6sc44ferda",
    "demo": "bagaaieralunt5htqs5qltrq7llif3c5ybcvp2rolzxq2gwrmtbdzt6dfqdxa",
    "demo_diloco": "bagaaierahj4dzio7chc4i2gznwuixiediruq363qeq7prqveyw3dyzj5fnqq",
    "small": "bagaaieraoqphqemybjlt3znuddi2j7rtpsnzewurleyv3sc3ior2ydb6fega",
    "llama_yarn": "bagaaieraeiwye3uzhkgndlb4xiormnmsmkldjr4yumdv2wzue4v6ddheuigq",
    "trimmed": "bagaaierasqgqz7ddtmxcqrgt3z6arrniegnacjojji7arwffnt562l2txjyq",
}


def _configs() -> dict[str, RunConfig]:
    rounds = RunConfig().rounds
    return {
        "default": RunConfig(),
        "demo": demo_config(),
        "demo_diloco": demo_config().plain_diloco(),
        "small": small_config(),
        "llama_yarn": RunConfig(model=ModelConfig(family="llama", n_kv_head=2, rope_type="yarn", rope_factor=4.0,
                                                  rope_original_max_position_embeddings=32, head_size=64)),
        "trimmed": RunConfig(rounds=dataclasses.replace(rounds, aggregator="trimmed_mean", overlap_start="eager",
                                                        clip_multiple=3.0, screen_margin=0.5)),
    }


def as_before_reveals(cfg: RunConfig) -> RunConfig:
    """``cfg`` as a configuration written before states were revealed on challenge reads today."""
    return cfg.replace(rounds=dataclasses.replace(cfg.rounds, state_reveal="upload"))


@pytest.mark.parametrize("name", sorted(RECORDED_CIDS))
def test_canonical_json_and_cid_are_those_recorded_before_the_declarations(name: str) -> None:
    cfg = _configs()[name]
    assert str(as_before_reveals(cfg).cid) == RECORDED_CIDS[name]
    assert RunConfig.from_json(cfg.to_json()) == cfg
    before = as_before_reveals(cfg).to_json()
    assert "state_reveal" not in before["rounds"] and RunConfig.from_json(before).rounds.state_reveal == "upload"
    if cfg.rounds.state_reveal == "on_challenge":  # the product's default names it, and so moves the CID
        assert cfg.to_json()["rounds"]["state_reveal"] == "on_challenge" and str(cfg.cid) != RECORDED_CIDS[name]


def _every_declared() -> list[tuple[str, Any, Any]]:
    return config_module._DECLARED


def test_every_range_refusal_names_the_field_value_and_range() -> None:
    checked = 0
    for name, f, _ in _every_declared():
        accepted: Range | None = f.metadata.get("range")
        if accepted is None:
            continue
        above = accepted.high * 2 + 1 if accepted.high > 0 else 1
        value: Any = int(above) if isinstance(accepted.high, int) and not isinstance(accepted.high, bool) else above
        section, _, field_name = name.rpartition(".")
        with pytest.raises(ConfigError) as refused:
            if section == "compression":  # past CompressionConfig's own (narrower) checks, to the run's
                compression = dataclasses.replace(RunConfig().compression)
                object.__setattr__(compression, field_name, value)
                RunConfig(compression=compression)
            else:
                RunConfig().with_settings([f"{name}={value}"])
        message = str(refused.value)
        assert name in message and str(accepted) in message, message
        checked += 1
    assert checked >= 50  # every numeric field of the run declares its range


def test_choices_come_from_the_literal_types() -> None:
    choices = {name: choices_of(kind) for name, _, kind in _every_declared() if choices_of(kind) is not None}
    assert choices == {"model.family": ("gpt", "llama", "qwen2"),
                       "model.rope_type": ("default", "linear", "llama3", "yarn"),
                       "rounds.overlap_start": ("delayed", "eager"),
                       "rounds.aggregator": ("mean", "trimmed_mean", "median"),
                       "inner.optimizer": ("adamw", "muon"),
                       "rounds.state_reveal": ("upload", "on_challenge")}
    assert config_module.AGGREGATORS == choices["rounds.aggregator"]
    for name, allowed in choices.items():
        for value in allowed:  # each choice is accepted where its relations allow (rope types need llama)
            base = RunConfig(model=ModelConfig(family="llama")) if name.startswith("model.") else RunConfig()
            settings = [f"{name}={value}"]
            if value in ("llama3", "yarn"):
                settings.append("model.rope_original_max_position_embeddings=64")
            assert str(getattr(getattr(base.with_settings(settings), name.split(".")[0]),
                               name.split(".")[1])) == value
        with pytest.raises(SettingError, match=rf"{name} = 'x{'y' * 39}' (is not supported: )?must be one of "
                                               rf"{', '.join(allowed)}"):
            RunConfig().with_settings([f"{name}=x{'y' * 200}"])  # at most 40 characters echoed


def test_a_choice_field_in_json_must_be_a_string() -> None:
    body = RunConfig().to_json()
    with pytest.raises(ConfigError, match=r"\$\.rounds\.aggregator: expected str, got int"):
        RunConfig.from_json({**body, "rounds": {**body["rounds"], "aggregator": 3}})


def test_help_lists_every_field_with_its_default_and_accepted_values() -> None:
    text = fields_help()
    lines = text.splitlines()
    assert len(lines) == len(_every_declared())
    assert "  inner.lr (float = 0.0004; (0, 10]): AdamW learning rate (of every parameter Muon does not train)" in lines
    assert any(line.startswith("  rounds.aggregator (choice = 'mean'; mean | trimmed_mean | median)") for line in lines)
    assert any(line.startswith("  rounds.clip_multiple (float = 2.0; 0 or [1, 100])") for line in lines)
    assert all(line.split(": ", 1)[1] for line in lines), "every field has a help text"


def test_range_admits_its_interval_and_its_off_value_only() -> None:
    clip = Range(1.0, 100.0, off=0.0, off_means="no clipping")
    assert [clip.admits(v) for v in (0.0, 0.5, 1.0, 100.0, 100.5, math.nan, math.inf)] == [
        True, False, True, True, False, False, False]
    assert clip.refusal("c", 0.5) == "c = 0.5 is out of range: must be 0 (no clipping) or in [1, 100]"
    half_open = Range(0.0, 1.0, low_open=True)
    assert not half_open.admits(0.0) and half_open.admits(1.0) and str(half_open) == "(0, 1]"

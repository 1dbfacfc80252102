"""Run configuration (canonical, strict) and data (deterministic shards and batches)."""

import json

import pytest
import torch

from storage_client import canonical_json
from tests.conftest import small_config
from trainer.config import ConfigError, DataConfig, RunConfig
from trainer.data.corpus import (
    CorpusError,
    embedded_corpus,
    eval_batches,
    load_corpus,
    round_batches,
)


def test_config_round_trips_and_floats_travel_as_strings() -> None:
    cfg = small_config()
    obj = cfg.to_json()
    assert obj["inner"]["lr"] == "0.001"
    assert RunConfig.from_json(json.loads(canonical_json(obj))) == cfg
    assert cfg.cid == RunConfig.from_json(obj).cid


def test_config_refuses_unknown_fields_and_wrong_types() -> None:
    obj = small_config().to_json()
    with pytest.raises(ConfigError, match=r"\$.inner: unknown field\(s\) lr_typo"):
        RunConfig.from_json({**obj, "inner": {**obj["inner"], "lr_typo": "1"}})
    with pytest.raises(ConfigError, match=r"\$.rounds.rounds: expected int, got bool"):
        RunConfig.from_json({**obj, "rounds": {**obj["rounds"], "rounds": True}})


def test_json_numbers_are_accepted_where_floats_are_written_as_text() -> None:
    # A hand-edited file writes "lr": 0.001; the canonical form writes "0.001". Same float, same CID.
    cfg = small_config()
    obj = json.loads(json.dumps(cfg.to_json()))
    as_numbers = {**obj, "inner": {**obj["inner"], "lr": 0.001, "weight_decay": float(obj["inner"]["weight_decay"])},
                  "outer": {**obj["outer"], "lr": float(obj["outer"]["lr"])}}
    assert RunConfig.from_json(as_numbers) == cfg
    assert RunConfig.from_json(as_numbers).cid == cfg.cid
    assert RunConfig.from_json({**obj, "inner": {**obj["inner"], "lr": 1}}).inner.lr == 1.0
    with pytest.raises(ConfigError, match=r"\$.inner.lr: expected a number, got bool"):
        RunConfig.from_json({**obj, "inner": {**obj["inner"], "lr": True}})
    with pytest.raises(ConfigError, match=r"\$.inner.lr: not a number: 'x{20}'"):
        RunConfig.from_json({**obj, "inner": {**obj["inner"], "lr": "x" * 20}})


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="n_embd must be divisible"):
        small_config(model=small_config().model.__class__(n_embd=30, n_head=4))


def test_embedded_corpus_is_deterministic_and_seeded() -> None:
    assert embedded_corpus(1, 5000) == embedded_corpus(1, 5000)
    assert embedded_corpus(1, 5000) != embedded_corpus(2, 5000)


def test_shards_partition_the_training_split() -> None:
    corpus = load_corpus(DataConfig(), seed=3, block_size=32)
    shards = [corpus.shard(i, 3) for i in range(3)]
    assert sum(len(s) for s in shards) <= len(corpus.train)
    assert torch.equal(torch.cat(shards), corpus.train[: 3 * len(shards[0])])


def test_batches_replay_exactly_per_shard_and_round() -> None:
    corpus = load_corpus(DataConfig(), seed=3, block_size=16)
    shard = corpus.shard(0, 2)
    kw = dict(seed=3, shard_index=0, steps=2, batch_size=4, block_size=16)
    a = [x for x, _ in round_batches(shard, round_=1, **kw)]
    b = [x for x, _ in round_batches(shard, round_=1, **kw)]
    c = [x for x, _ in round_batches(shard, round_=2, **kw)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0])
    x, y = next(round_batches(shard, round_=1, **kw))
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    e1 = eval_batches(corpus, seed=3, count=2, batch_size=4, block_size=16)
    e2 = eval_batches(corpus, seed=3, count=2, batch_size=4, block_size=16)
    assert torch.equal(e1[1][0], e2[1][0])


def test_corpus_digest_mismatch_is_refused(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("hello world " * 1000)
    with pytest.raises(CorpusError, match="has sha256 .* configured with"):
        load_corpus(DataConfig(corpus=str(path), corpus_sha256="0" * 64), seed=0, block_size=16)
    with pytest.raises(CorpusError, match="cannot read corpus"):
        load_corpus(DataConfig(corpus=str(tmp_path / "missing.txt")), seed=0, block_size=16)


# -- every numeric field has a range; values outside it, NaN and infinities are refused by name ----

import dataclasses  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

from trainer import config as config_module  # noqa: E402
from trainer.config import InnerConfig, ModelConfig, RoundConfig, demo_config  # noqa: E402

# (field, values outside its range): each must be refused with the field named.
OUT_OF_RANGE = [
    ("seed", [-1, 2**63]),
    ("model.vocab_size", [255, 262_145]),
    ("model.block_size", [1, 16_385]),
    ("model.n_layer", [0, 257]),
    ("model.n_head", [0, 257]),
    ("model.n_embd", [0, 16_385]),
    ("model.n_kv_head", [-1, 257]),
    ("model.intermediate_size", [-1, (1 << 20) + 1]),
    ("model.rope_theta", [0.5, 2e9]),
    ("model.rms_norm_eps", [0.0, 0.1]),
    ("model.head_size", [-1, 1025]),
    ("model.rope_factor", [0.5, 1e5]),
    ("model.rope_original_max_position_embeddings", [-1, (1 << 24) + 1]),
    ("model.rope_low_freq_factor", [0.0, 1e5]),
    ("model.rope_high_freq_factor", [0.0, 1e5]),
    ("model.rope_beta_fast", [0.0, 1e5]),
    ("model.rope_beta_slow", [-1.0, 1e5]),
    ("model.rope_attention_factor", [-0.5, 101.0]),
    ("inner.steps", [0, 1_000_001]),
    ("inner.batch_size", [0, 4097]),
    ("inner.lr", [0.0, -1e-3, 10.5]),
    ("inner.weight_decay", [-0.1, 11.0]),
    ("inner.beta1", [-0.1, 1.0]),
    ("inner.beta2", [-0.1, 1.0]),
    ("inner.grad_clip", [-1.0, 2e6]),
    ("inner.min_steps", [0, 1_000_001]),
    ("inner.muon_lr", [0.0, -1e-3, 10.5]),
    ("inner.muon_momentum", [-0.1, 1.0]),
    ("outer.lr", [0.0, 11.0]),
    ("outer.momentum", [-0.1, 1.0]),
    ("data.eval_fraction", [0.0, 0.6]),
    ("data.eval_batches", [0, 10_001, 10_000_000]),
    ("rounds.rounds", [0, 1_000_001]),
    ("rounds.expected_workers", [0, 1025, 100_000]),
    ("rounds.quorum", [0]),
    ("rounds.straggler_timeout_s", [0.0, 0.01, 86_401.0]),
    ("rounds.heartbeat_interval_s", [0.0, 0.01, 61.0]),
    ("rounds.liveness_timeout_s", [0.0, 3601.0]),
    ("rounds.max_update_norm", [-1.0, 2e12]),
    ("rounds.checkpoint_every", [0, 1_000_001]),
    ("rounds.state_every", [-1, 0, 6, 1_000_001]),
    ("rounds.reveal_rounds", [0, 1_000_001]),
    ("rounds.reveal_deadline_s", [0.0, 86_401.0]),
    ("compression.target_energy", [0.0, 1.5]),
    ("compression.min_rank", [4097]),
    ("compression.max_rank", [4097]),
    ("compression.window", [1001]),
    ("compression.max_rank_factor", [1001.0]),
    ("compression.int4_group_size", [(1 << 20) + 1]),
    ("compression.int8_group_size", [(1 << 20) + 1]),
    ("compression.topk_density", [0.0, 1.5, float("nan")]),
    ("compression.topk_chunk", [0, 65_537]),
    ("compression.error_decay", [-0.1, 1.5, float("nan")]),
]


def _with(name: str, value: object) -> RunConfig:
    base = RunConfig()
    if "." not in name:
        return base.replace(**{name: value})
    section, field_name = name.split(".")
    if section == "compression":  # past CompressionConfig's own (narrower) checks, to reach _validate
        return base.replace(compression=_bypass_compression(**{field_name: value}))
    return base.replace(**{section: dataclasses.replace(getattr(base, section), **{field_name: value})})


def _refused(name: str, value: object) -> str:
    with pytest.raises(ConfigError) as info:
        _with(name, value)
    message = str(info.value)
    assert name in message, message
    return message


@pytest.mark.parametrize("name, values", OUT_OF_RANGE, ids=[n for n, _ in OUT_OF_RANGE])
def test_out_of_range_values_are_refused_naming_field_value_and_range(name: str, values: list) -> None:
    for value in values:
        message = _refused(name, value)
        assert repr(value) in message or str(value) in message, message
        if name != "rounds.quorum":
            assert says_its_range(message), message


def test_every_ranged_field_is_tested_and_exists() -> None:
    assert {name for name, _ in OUT_OF_RANGE} == set(config_module._RANGES)
    numeric = {name for name, _ in config_module._numeric_fields(RunConfig())}
    assert set(config_module._RANGES) <= numeric


@pytest.mark.parametrize("name", sorted(config_module._RANGES))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(name: str, value: float) -> None:
    message = _refused(name, value)
    assert says_its_range(message), message


def says_its_range(message: str) -> bool:
    """A range refusal: "must be in [a, b]", or, for a field with an off value, "must be 0 (what
    0 means) or in [a, b]"."""
    return "must be in" in message or re.search(r"must be \S+ \([^)]*\) or in \[", message) is not None


def test_non_finite_from_json_is_refused() -> None:
    obj = RunConfig().to_json()
    for section, name in (("inner", "lr"), ("outer", "lr"), ("rounds", "straggler_timeout_s")):
        for text in ("inf", "nan", "-inf"):
            with pytest.raises(ConfigError, match=rf"{section}\.{name} = "):
                RunConfig.from_json({**obj, section: {**obj[section], name: text}})


def test_defaults_and_demo_config_are_valid() -> None:
    RunConfig()
    demo_config()
    small_config()
    assert config_module._validate(RunConfig()) == []
    assert config_module._validate(demo_config()) == []


def test_relations_between_fields() -> None:
    with pytest.raises(ConfigError, match=r"rounds\.quorum = 3 must be in \[1, expected_workers = 2\]"):
        RunConfig(rounds=RoundConfig(expected_workers=2, quorum=3))
    with pytest.raises(ConfigError, match=r"rounds\.liveness_timeout_s = 1\.0 must exceed"):
        RunConfig(rounds=RoundConfig(heartbeat_interval_s=1.0, liveness_timeout_s=1.0))
    with pytest.raises(ConfigError, match="compression.min_rank = 9 must not exceed compression.max_rank = 8"):
        RunConfig(compression=_bypass_compression(min_rank=9, max_rank=8))
    with pytest.raises(ConfigError, match="inner.min_steps = 11 must not exceed inner.steps = 10"):
        RunConfig(inner=InnerConfig(steps=10, min_steps=11))


def test_adaptive_steps_needs_the_low_rank_downlink() -> None:
    adaptive = InnerConfig(steps=10, min_steps=2, adaptive_steps=True)
    assert RunConfig(inner=adaptive).inner.adaptive_steps  # the defaults compress with low rank
    with pytest.raises(ConfigError, match="inner.adaptive_steps follows the downlink's rank"):
        RunConfig(inner=adaptive).plain_diloco()
    with pytest.raises(ConfigError, match="inner.adaptive_steps follows the downlink's rank"):
        RunConfig(inner=adaptive, compression=dataclasses.replace(RunConfig().compression, codec="topk"))


def _bypass_compression(**changes: object):
    """A CompressionConfig with values its own __post_init__ would refuse, to reach _validate."""
    c = dataclasses.replace(RunConfig().compression)
    for name, value in changes.items():
        object.__setattr__(c, name, value)
    return c


def test_eval_memory_and_model_size_are_bounded() -> None:
    # 10_000 batches is in range alone, but not with 4096-sequence batches of 16k tokens
    with pytest.raises(ConfigError, match=r"data\.eval_batches = 10000 holds .* held-out tokens"):
        RunConfig(data=DataConfig(eval_batches=10_000), inner=InnerConfig(batch_size=64),
                  model=ModelConfig(block_size=1024))
    RunConfig(data=DataConfig(eval_batches=10_000), inner=InnerConfig(batch_size=1), model=ModelConfig(block_size=64))
    with pytest.raises(ConfigError, match="parameters; at most"):
        RunConfig(model=ModelConfig(n_layer=256, n_embd=16_384, n_head=256))


def test_explicit_update_norm_below_one_inner_step_is_refused() -> None:
    """An explicit bound smaller than one AdamW step's norm would refuse every honest update, so no
    round would ever close; 0 (derive) and a plausible bound are accepted."""
    with pytest.raises(ConfigError, match=r"rounds\.max_update_norm = 1e-09 is below .*use 0 to derive"):
        RunConfig(rounds=RoundConfig(max_update_norm=1e-9))
    RunConfig(rounds=RoundConfig(max_update_norm=0.0))
    floor = RunConfig().inner.lr * math.sqrt(config_module.estimated_parameters(ModelConfig()))
    RunConfig(rounds=RoundConfig(max_update_norm=floor * 1.01))
    with pytest.raises(ConfigError, match="max_update_norm"):
        RunConfig(rounds=RoundConfig(max_update_norm=floor * 0.99))


def test_estimated_parameters_match_the_model() -> None:
    from trainer.model.gpt import GPT

    for cfg in (ModelConfig(), ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)):
        assert config_module.estimated_parameters(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_empty_and_too_small_corpus_are_refused_naming_the_file(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CorpusError, match=f"corpus {empty} is empty"):
        load_corpus(DataConfig(corpus=str(empty)), seed=0, block_size=16)
    small = tmp_path / "small.txt"
    small.write_text("x" * 100)
    with pytest.raises(CorpusError, match=f"corpus {small} is too small"):
        load_corpus(DataConfig(corpus=str(small)), seed=0, block_size=16)

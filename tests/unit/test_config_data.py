"""Run configuration (canonical, strict) and data (deterministic shards and batches)."""

import json

import pytest
import torch

from storage_client import canonical_json
from tests.conftest import small_config
from trainer.config import ConfigError, DataConfig, RunConfig
from trainer.data import (
    CorpusError, embedded_corpus, eval_batches, load_corpus, round_batches,
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

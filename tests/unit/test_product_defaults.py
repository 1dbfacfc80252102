"""The product runs DiLoCoX by default (trainer.config.RunConfig), plain DiLoCo is one switch away,
and the benchmark measures what the product runs."""

from __future__ import annotations

from trainer.config import (
    DILOCO_OUTER, DILOCOX_COMPRESSION, DILOCOX_OUTER, SCHEMA, CompressionConfig, OuterConfig, RoundConfig,
    RunConfig, demo_config,
)


def test_the_default_run_and_the_demo_are_dilocox() -> None:
    for config in (RunConfig(), demo_config()):
        assert config.compression.enabled and config.compression == DILOCOX_COMPRESSION
        assert config.rounds.overlap and config.rounds.overlap_start == "delayed"
        assert config.outer == DILOCOX_OUTER


def test_a_file_that_names_part_of_a_section_keeps_the_rest_of_dilocox() -> None:
    config = RunConfig.from_json({"schema": SCHEMA, "rounds": {"rounds": 3}, "compression": {"max_rank": 24}})
    assert config.rounds.rounds == 3 and config.rounds.overlap
    assert config.compression.enabled and config.compression.max_rank == 24 and config.compression.min_rank == 16
    assert RunConfig.from_json(RunConfig().to_json()) == RunConfig()


def test_plain_diloco_is_one_switch() -> None:
    plain = demo_config().plain_diloco()
    assert not plain.compression.enabled and not plain.rounds.overlap and plain.outer == DILOCO_OUTER == OuterConfig()
    assert plain.replace(compression=DILOCOX_COMPRESSION, rounds=RoundConfig(**{**plain.rounds.__dict__, "overlap": True}),
                         outer=DILOCOX_OUTER) == demo_config()
    # the building blocks keep their own neutral defaults
    assert not CompressionConfig().enabled and not RoundConfig().overlap


def test_the_benchmark_measures_the_product_settings() -> None:
    from benchmarks.ablation.modes import DILOCOX_START, TUNED_OUTER

    assert TUNED_OUTER["dilocox"] == (DILOCOX_OUTER.lr, DILOCOX_OUTER.momentum)
    assert DILOCOX_START == RunConfig().rounds.overlap_start

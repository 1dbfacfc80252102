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
        assert config.inner.optimizer == "adamw"  # Muon is a choice (README, "Against dense DiLoCo")


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
    from benchmarks.ablation.modes import BY_KEY

    assert BY_KEY["dilocox"].inner_optimizer == RunConfig().inner.optimizer == "adamw"


def test_the_adaptive_steps_row_runs_until_it_has_the_budget_of_tokens() -> None:
    """H_r ≥ H/2, so 2R rounds always reach R·H steps' tokens; every other row runs R rounds."""
    from pathlib import Path

    from benchmarks.ablation.measure import Data, Settings
    from benchmarks.ablation.modes import BY_KEY, rounds_for_tokens, run_config
    from trainer.config import DataConfig, ModelConfig

    s = Settings(workers=2, rounds=8, inner_steps=50, throughput_rounds=4, allreduce_throughput_steps=3,
                 link_ratio=350.0, link_latency_ms=2.0, batch_size=16, model=ModelConfig(), eval_batches=4,
                 modes=[], seeds=[1337], data=Path("."), out=Path("."), smoke=False, keep_runs=False)
    data = Data("embedded", DataConfig(corpus="embedded"), None, False)  # type: ignore[arg-type]
    adaptive, fixed = BY_KEY["adaptive-steps"], BY_KEY["dilocox"]
    config = run_config(adaptive, s, data, rounds_for_tokens(adaptive, s.rounds, s.inner_steps), 1337)
    assert config.inner.adaptive_steps and config.inner.min_steps == 25 and config.rounds.rounds == 16
    assert config.replace(inner=run_config(fixed, s, data, 16, 1337).inner, run_id="ablation-dilocox") \
        == run_config(fixed, s, data, 16, 1337)  # DiLoCoX in every other setting
    assert rounds_for_tokens(fixed, s.rounds, s.inner_steps) == 8 and rounds_for_tokens(adaptive, 3, 5) == 8


def test_each_ablation_mode_is_dilocox_with_its_own_technique_changed() -> None:
    """Each DiLoCo row of the ablation runs a configuration that validates and is DiLoCoX's own
    except for what the row is about (its technique, its tuned outer step, its run id), so the
    integration smoke can leave out the rows that add no code of their own."""
    from dataclasses import replace
    from pathlib import Path

    from benchmarks.ablation.measure import Data, Settings
    from benchmarks.ablation.modes import (
        BY_KEY,
        FIXED_RANK,
        MODES,
        OTHER_START,
        TOPK_ERROR_DECAY,
        outer_config,
        run_config,
    )
    from trainer.config import DataConfig, ModelConfig

    s = Settings(workers=2, rounds=2, inner_steps=4, throughput_rounds=2, allreduce_throughput_steps=2,
                 link_ratio=20.0, link_latency_ms=2.0, batch_size=4, model=ModelConfig(), eval_batches=2,
                 modes=[], seeds=[1337], data=Path("."), out=Path("."), smoke=True, keep_runs=False)
    data = Data("embedded", DataConfig(corpus="embedded"), None, False)  # type: ignore[arg-type]
    base = run_config(BY_KEY["dilocox"], s, data, 2, 1337)
    expected = {
        "diloco": dict(compression=replace(base.compression, enabled=False),
                       rounds=replace(base.rounds, overlap=False)),
        "diloco-muon": dict(compression=replace(base.compression, enabled=False), rounds=replace(base.rounds, overlap=False),
                            inner=replace(base.inner, optimizer="muon", muon_lr=8e-3)),
        "dilocox": {},
        "muon": dict(inner=replace(base.inner, optimizer="muon", muon_lr=4e-3)),
        "no-compression": dict(compression=replace(base.compression, enabled=False)),
        "no-overlap": dict(rounds=replace(base.rounds, overlap=False)),
        "fixed-rank": dict(compression=replace(base.compression, min_rank=FIXED_RANK, max_rank=FIXED_RANK)),
        "other-start": dict(rounds=replace(base.rounds, overlap_start=OTHER_START)),
        "adaptive-steps": dict(inner=replace(base.inner, adaptive_steps=True, min_steps=2)),
        "topk": dict(compression=replace(base.compression, codec="topk", topk_density=0.01,
                                         error_decay=TOPK_ERROR_DECAY)),
        "pipeline": {},
    }
    for mode in MODES:
        if mode.allreduce:
            continue
        config = run_config(mode, s, data, 2, 1337, topk_density=0.01)
        assert config == base.replace(run_id=f"ablation-{mode.key}", outer=outer_config(mode),
                                      **expected.pop(mode.key)), mode.key
    assert not expected, f"modes without a stated difference: {sorted(expected)}"

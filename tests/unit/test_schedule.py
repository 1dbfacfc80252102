"""DiLoCoX's adaptive number of inner steps (trainer.rounds.schedule.inner_steps_for_round)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from trainer.codec import (
    AdaptiveRankPolicy,
    CodecHeader,
    CodecKind,
    TensorEntry,
    compress,
)
from trainer.codec.wire import layout_of
from trainer.config import InnerConfig, RunConfig
from trainer.rounds.schedule import (
    ScheduleError,
    StepsDecision,
    WorkerSchedule,
    inner_steps_for_round,
    rank_fraction,
    round_tokens,
)


def _config(steps: int = 40, min_steps: int = 1, adaptive: bool = True, max_rank: int = 16) -> RunConfig:
    base = RunConfig()
    compression = type(base.compression)(enabled=True, min_rank=1, max_rank=max_rank)
    return base.replace(inner=InnerConfig(steps=steps, min_steps=min_steps, adaptive_steps=adaptive),
                        compression=compression)


def _header(*entries: tuple[str, int]) -> CodecHeader:
    """A header of the given (kind, rank) matrices plus one int8 vector (which ρ ignores)."""
    tensors = [TensorEntry(f"w{i}", (32, 32), "float32", kind, rank, 64, {}) for i, (kind, rank) in enumerate(entries)]
    tensors.append(TensorEntry("bias", (32,), "float32", CodecKind.INT8, 0, 64, {}))
    return CodecHeader(tuple(tensors))


def test_the_first_two_rounds_and_the_fixed_schedule_train_h() -> None:
    low = _header((CodecKind.LOWRANK_INT4, 1), (CodecKind.LOWRANK_INT4, 1))
    config = _config()
    assert [inner_steps_for_round(config, r, low) for r in (1, 2)] == [40, 40]
    assert inner_steps_for_round(config, 3, low) < 40
    assert inner_steps_for_round(_config(adaptive=False), 3, low) == 40
    assert inner_steps_for_round(config, 3, None) == 40  # round 1's update travelled dense


def test_h_follows_the_mean_rank_fraction() -> None:
    config = _config(steps=40, max_rank=16)
    # ρ = (4/16 + 8/16) / 2 = 3/8: H_r = 40 · 3/8 = 15
    header = _header((CodecKind.LOWRANK_INT4, 4), (CodecKind.LOWRANK_INT4, 8))
    assert rank_fraction(config, header) == Fraction(3, 8)
    assert inner_steps_for_round(config, 3, header) == 15
    # a rank above r_max counts as r_max; a dense int4 matrix counts as 1
    assert rank_fraction(config, _header((CodecKind.LOWRANK_INT4, 30), (CodecKind.INT4, 0))) == 1
    assert rank_fraction(config, _header((CodecKind.LOWRANK_INT4, 2), (CodecKind.INT4, 0))) == Fraction(9, 16)
    assert inner_steps_for_round(config, 7, _header((CodecKind.LOWRANK_INT4, 2), (CodecKind.INT4, 0))) == 23  # 22.5 rounds up
    assert round_tokens(config, 15) == 15 * config.inner.batch_size * config.model.block_size


def test_h_is_clamped_to_min_steps() -> None:
    header = _header((CodecKind.LOWRANK_INT4, 1), (CodecKind.LOWRANK_INT4, 1))  # ρ = 1/16: 40/16 = 2.5 -> 3
    assert inner_steps_for_round(_config(min_steps=1), 3, header) == 3
    assert inner_steps_for_round(_config(min_steps=10), 3, header) == 10
    assert inner_steps_for_round(_config(steps=4, min_steps=1), 3, header) == 1  # 0.25 rounds to 0: floor 1


def test_a_real_downlink_header() -> None:
    torch.manual_seed(0)
    update = {"a": torch.randn(32, 24), "b": torch.randn(16, 40), "c": torch.randn(8)}
    _, raw = compress(update, {}, AdaptiveRankPolicy.fixed(2))
    header = CodecHeader.parse(raw, layout_of(update))
    # both matrices low rank at 2 of r_max 16: ρ = 1/8, H_r = 5
    assert inner_steps_for_round(_config(), 3, header) == 5


def test_a_worker_derives_h_when_it_holds_the_header_and_checks_the_declaration() -> None:
    config = _config(steps=40, max_rank=16)
    header = _header((CodecKind.LOWRANK_INT4, 4), (CodecKind.LOWRANK_INT4, 8))  # H_r = 15
    schedule = WorkerSchedule(config)
    schedule.learn(1, 40, 15, header)  # θ⁽¹⁾ came compressed: round 3 is derivable
    assert schedule.decide(2) == StepsDecision(40, None, "derived")
    assert schedule.decide(3) == StepsDecision(15, 0.375, "derived")
    schedule.learn(1, 40, 14, header)  # a coordinator declaring another H_3 than round 1's header gives
    with pytest.raises(ScheduleError, match="round 3: the coordinator declares 14 inner steps, but round 1's"):
        schedule.decide(3)


def test_a_late_joiner_takes_the_declared_h_within_bounds() -> None:
    schedule = WorkerSchedule(_config(steps=40))
    schedule.learn(5, 12, 30, None)  # θ⁽⁵⁾ fetched dense: no header of round 4 or 5
    assert schedule.decide(6) == StepsDecision(12, None, "declared")
    assert schedule.decide(7) == StepsDecision(30, None, "declared")
    with pytest.raises(ScheduleError, match="no declared inner steps and no codec header of round 6"):
        schedule.decide(8)
    for bad in (0, 41):
        with pytest.raises(ScheduleError, match=f"declares {bad} inner steps for round 7; .* 1 to inner.steps = 40"):
            WorkerSchedule(_config(steps=40)).learn(5, 12, bad, None)

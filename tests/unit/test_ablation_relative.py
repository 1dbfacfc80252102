"""benchmarks.ablation.relative: every row against dense DiLoCo (loss ratio per seed, bytes per
round, time to DiLoCo's loss on the 1 Gbps-equivalent link), as pure arithmetic."""

from __future__ import annotations

import math

import pytest

from benchmarks.ablation.relative import (
    against_dense,
    bytes_per_round,
    equivalent_bandwidth_bps,
    round_seconds,
    time_to_loss,
)


def test_a_dense_fp32_model_crosses_the_equivalent_link_in_a_1b_models_time_on_1_gbps() -> None:
    n = 470_528
    assert 8 * 4 * n / equivalent_bandwidth_bps(n) == pytest.approx(8 * 4 * 1e9 / 1e9)


def test_bytes_per_round_is_the_median_of_the_later_rounds() -> None:
    rounds = [{"round": 1, "bytes_sent": 0, "bytes_received": 300},  # the join
              *({"round": r, "bytes_sent": 100, "bytes_received": 90} for r in range(2, 8)),
              {"round": 5, "bytes_sent": 5_000_000, "bytes_received": 90}]  # an inner-state upload
    assert bytes_per_round(rounds) == 190
    assert math.isnan(bytes_per_round([{"round": 1, "bytes_sent": 1, "bytes_received": 1}]))


def test_an_overlapped_round_hides_the_shorter_of_compute_and_exchange() -> None:
    assert round_seconds(2.0, 1.0, overlap=False, rounds=3) == 9.0
    assert round_seconds(2.0, 1.0, overlap=True, rounds=3) == 2.0 + 2 * 2.0 + 1.0
    assert round_seconds(2.0, 5.0, overlap=True, rounds=3) == 2.0 + 2 * 5.0 + 5.0
    assert round_seconds(2.0, 5.0, overlap=True, rounds=0) == 0.0


def test_time_to_loss_is_the_first_checkpoint_at_or_below_the_target() -> None:
    curve = [(0, 5.5), (100, 2.5), (200, 2.1), (300, 2.0)]
    assert time_to_loss(curve, 2.1, 1.0, 0.5, overlap=False) == 2 * 1.5
    assert math.isnan(time_to_loss(curve, 1.9, 1.0, 0.5, overlap=False))


def _row(losses: dict[int, float], overlap: str = "no", sent: float = 100.0) -> dict:
    per_round = [{"round": r, "bytes_sent": sent, "bytes_received": sent} for r in (1, 2, 3)]
    return {"overlap": overlap, "loss_mean": sum(losses.values()) / len(losses),
            "curve": [(0, 5.5), (1, 2.4), (2, min(losses.values()))],
            "seeds": [{"seed": s, "final_loss": v, "per_round": per_round, "sent": 2 * sent, "received": 2 * sent}
                      for s, v in losses.items()]}


def test_every_row_is_measured_against_dilocos_seeds() -> None:
    rows = {"allreduce": _row({1: 1.8, 2: 2.0}, sent=1000.0), "diloco": _row({1: 2.0, 2: 2.2}),
            "topk": _row({1: 2.2, 2: 2.0}, overlap="delayed", sent=10.0),
            "lowrank": _row({1: 2.3, 2: 2.3}, sent=10.0), "broken": {"failed": "failed: x"}}
    out = against_dense(rows, t_step_s=0.01, inner_steps=50, parameters=1_000_000, latency_s=0.0)
    assert out["target_loss"] == pytest.approx(2.1) and out["compute_s"] == pytest.approx(0.5)
    assert rows["diloco"]["diloco_ratio_mean"] == 1.0 and rows["diloco"]["diloco_ratio_sd"] == 0.0
    assert rows["topk"]["diloco_ratio_mean"] == pytest.approx((2.2 / 2.0 + 2.0 / 2.2) / 2)
    assert rows["topk"]["round_bytes_x_fewer"] == pytest.approx(10.0)
    exchange = 8 * 20 / 1e6  # bytes per round over the 1 Mbit/s equivalent of a 1M-parameter model
    assert rows["topk"]["time_to_dense_s"] == pytest.approx(0.5 + 0.5 + exchange)  # round 2, overlapped
    assert math.isnan(rows["lowrank"]["time_to_dense_s"])  # never at or below 2.1
    assert rows["allreduce"]["bytes_per_round"] == pytest.approx(4000 / 2)  # its totals over its 2 "rounds"
    assert "diloco_ratio_mean" not in rows["broken"]
    assert against_dense({"topk": rows["topk"]}, 0.01, 50, 1_000_000, 0.0) == {}  # no DiLoCo row


def test_time_rounds_train_past_r_and_never_fewer() -> None:
    """``--time-rounds`` lets the DiLoCo modes train past R for the time column; below R it is refused."""
    import argparse

    from benchmarks.ablation import add_arguments, settings_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_of(parser.parse_args(["--time-rounds", "16"])).time_rounds == 16
    assert settings_of(parser.parse_args([])).time_rounds == 0
    with pytest.raises(ValueError, match="--time-rounds must be >= --rounds"):
        settings_of(parser.parse_args(["--time-rounds", "4"]))

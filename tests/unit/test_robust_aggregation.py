"""trainer.aggregation.aggregate: clipping to c × the lower median norm, and its re-derivation."""

from __future__ import annotations

import math

import pytest
import torch

from audit.rederive import rederive, update_norms
from trainer.aggregation import aggregate, exact_norm, lower_median, mean_pseudo_gradient
from trainer.config import OuterConfig, RoundConfig, RunConfig
from trainer.config import ConfigError
from trainer.diloco import outer_state_of, outer_step
from trainer.wire import encode_params


def update(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(30, 40, generator=g) * scale, "b.bias": torch.randn(50, generator=g) * scale}


def scaled(u: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in u.items()}


def test_exact_norm_is_the_l2_norm_and_order_free() -> None:
    u = update(0)
    want = math.sqrt(sum(float(t.double().pow(2).sum()) for t in u.values()))
    assert exact_norm(u) == pytest.approx(want, rel=1e-12)
    assert exact_norm(dict(reversed(list(u.items())))) == exact_norm(u)


def test_lower_median_takes_the_smaller_middle() -> None:
    assert lower_median([5.0, 1.0]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        lower_median([])


def test_a_scaled_update_is_clipped_to_c_times_the_honest_one() -> None:
    honest, attacker = update(1), scaled(update(2), 86.0)
    result = aggregate({"h": honest, "m": attacker}, 2.0)
    assert result.clipped == ["m"]
    assert result.threshold == pytest.approx(2 * exact_norm(honest))
    # the attacker's contribution now has norm ≤ c × the honest norm (float32 rounding aside)
    contribution = {k: v * result.scales["m"] for k, v in attacker.items()}
    assert exact_norm(contribution) == pytest.approx(2 * exact_norm(honest), rel=1e-6)
    plain = aggregate({"h": honest, "m": attacker}, 0.0)  # clipping off: the attacker dominates
    assert plain.clipped == [] and math.isinf(plain.threshold)
    assert exact_norm(plain.delta) > 40 * exact_norm(honest)
    assert exact_norm(result.delta) < 1.6 * exact_norm(honest)


def test_honest_updates_are_not_touched() -> None:
    updates = {f"w{i}": update(i) for i in range(4)}
    result = aggregate(updates, 2.0)
    assert result.clipped == []
    got, want = result.delta, mean_pseudo_gradient(updates)
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit the plain mean


def test_breakdown_a_minority_cannot_raise_the_threshold_a_majority_can() -> None:
    honest = {f"h{i}": update(i) for i in range(3)}
    h_max = max(exact_norm(u) for u in honest.values())
    two_bad = {f"m{i}": scaled(update(10 + i), 100.0) for i in range(2)}
    result = aggregate({**honest, **two_bad}, 2.0)  # 2 of 5: every update enters at ≤ 2 × an honest norm
    assert result.threshold <= 2 * h_max
    assert result.clipped == ["m0", "m1"]
    three_bad = {f"m{i}": scaled(update(10 + i), 100.0) for i in range(3)}
    broken = aggregate({"h0": honest["h0"], "h1": honest["h1"], **three_bad}, 2.0)  # a majority of 5
    assert broken.threshold > 100 * h_max and broken.clipped == []


def test_history_guards_a_round_with_one_update() -> None:
    alone = scaled(update(3), 86.0)
    assert aggregate({"m": alone}, 2.0).clipped == []  # its own median: nothing to compare with
    history = [exact_norm(update(i)) for i in range(4)]
    result = aggregate({"m": alone}, 2.0, history)
    assert result.clipped == ["m"] and result.threshold == pytest.approx(2 * lower_median(history + [exact_norm(alone)]))


def test_aggregation_is_deterministic_and_order_free() -> None:
    updates = {"w1": update(1), "w0": scaled(update(0), 50.0), "w2": update(2)}
    first = aggregate(updates, 3.0, [1e-3, 2e-3])
    again = aggregate(dict(reversed(list(updates.items()))), 3.0, [2e-3, 1e-3])
    assert first.clipped == ["w0"] and first.scales == again.scales
    assert all(torch.equal(first.delta[k], again.delta[k]) for k in first.delta)


def test_the_audit_rederives_the_clipped_round_bit_for_bit() -> None:
    cfg = OuterConfig()
    params, momentum = update(20, 1.0), update(21, 0.1)
    updates = {"w0": update(1), "w1": scaled(update(2), 86.0), "w2": update(3)}
    history = [exact_norm(update(4)), exact_norm(update(5))]
    delta = aggregate(updates, 2.0, history).delta
    want_params, want_momentum = outer_step(cfg, params, momentum, delta)
    stored = {w: encode_params(u) for w, u in updates.items()}
    derived = rederive(cfg, encode_params(params), encode_params(outer_state_of(momentum)), stored,
                       clip_multiple=2.0, history=history)
    assert derived.params == encode_params(want_params)
    assert derived.outer_state == encode_params(outer_state_of(want_momentum))
    assert derived.norms == update_norms(stored) == {w: exact_norm(u) for w, u in updates.items()}
    # the plain mean (or another multiple, or no history) gives other bytes: the audit would notice
    for kwargs in ({}, {"clip_multiple": 3.0, "history": history}, {"clip_multiple": 2.0}):
        other = rederive(cfg, encode_params(params), encode_params(outer_state_of(momentum)), stored, **kwargs)
        assert other.params != derived.params


def test_config_range() -> None:
    assert RunConfig().rounds.clip_multiple == 2.0
    RunConfig(rounds=RoundConfig(clip_multiple=0.0))
    for bad in (0.5, 101.0, float("nan")):
        with pytest.raises(ConfigError, match="clip_multiple"):
            RunConfig(rounds=RoundConfig(clip_multiple=bad))
    with pytest.raises(ConfigError, match="clip_history_rounds"):
        RunConfig(rounds=RoundConfig(clip_history_rounds=65))
    assert RunConfig().rounds.screen_margin == 0.0  # screening is opt-in
    with pytest.raises(ConfigError, match="screen_margin"):
        RunConfig(rounds=RoundConfig(screen_margin=-1.0))

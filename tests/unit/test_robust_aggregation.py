"""trainer.rounds.aggregation.aggregate: clipping to c × the lower median norm, the robust means after it
(trimmed mean, coordinate-wise lower median), and their re-derivation."""

from __future__ import annotations

import math

import pytest
import torch

from audit.rederive import rederive, update_norms
from tests.oracles import mean_pseudo_gradient
from trainer.codec.wire import encode_params
from trainer.config import ConfigError, OuterConfig, RoundConfig, RunConfig
from trainer.rounds.aggregation import (
    PLAIN_MEAN,
    aggregate,
    exact_norm,
    lower_median,
    trimmed_count,
)
from trainer.rounds.outer import outer_state_of, outer_step


def update(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(30, 40, generator=g) * scale, "b.bias": torch.randn(50, generator=g) * scale}


def scaled(u: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in u.items()}


def rule(clip: float = 2.0, aggregator: str = "mean", trim: float = 0.2) -> RoundConfig:
    """The aggregation settings of a run's ``rounds`` section (validated as a run's are)."""
    return RunConfig(rounds=RoundConfig(clip_multiple=clip, aggregator=aggregator, trim_fraction=trim)).rounds


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
    result = aggregate({"h": honest, "m": attacker}, rule(2.0))
    assert result.clipped == ["m"]
    assert result.threshold == pytest.approx(2 * exact_norm(honest))
    # the attacker's contribution now has norm ≤ c × the honest norm (float32 rounding aside)
    contribution = {k: v * result.scales["m"] for k, v in attacker.items()}
    assert exact_norm(contribution) == pytest.approx(2 * exact_norm(honest), rel=1e-6)
    plain = aggregate({"h": honest, "m": attacker}, rule(0.0))  # clipping off: the attacker dominates
    assert plain.clipped == [] and math.isinf(plain.threshold)
    assert exact_norm(plain.delta) > 40 * exact_norm(honest)
    assert exact_norm(result.delta) < 1.6 * exact_norm(honest)


def test_honest_updates_are_not_touched() -> None:
    updates = {f"w{i}": update(i) for i in range(4)}
    result = aggregate(updates, rule(2.0))
    assert result.clipped == []
    got, want = result.delta, mean_pseudo_gradient(updates)
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit the plain mean


def test_breakdown_a_minority_cannot_raise_the_threshold_a_majority_can() -> None:
    honest = {f"h{i}": update(i) for i in range(3)}
    h_max = max(exact_norm(u) for u in honest.values())
    two_bad = {f"m{i}": scaled(update(10 + i), 100.0) for i in range(2)}
    result = aggregate({**honest, **two_bad}, rule(2.0))  # 2 of 5: every update enters at ≤ 2 × an honest norm
    assert result.threshold <= 2 * h_max
    assert result.clipped == ["m0", "m1"]
    three_bad = {f"m{i}": scaled(update(10 + i), 100.0) for i in range(3)}
    broken = aggregate({"h0": honest["h0"], "h1": honest["h1"], **three_bad}, rule(2.0))  # a majority of 5
    assert broken.threshold > 100 * h_max and broken.clipped == []


def test_history_guards_a_round_with_one_update() -> None:
    alone = scaled(update(3), 86.0)
    assert aggregate({"m": alone}, rule(2.0)).clipped == []  # its own median: nothing to compare with
    history = [exact_norm(update(i)) for i in range(4)]
    result = aggregate({"m": alone}, rule(2.0), history)
    assert result.clipped == ["m"] and result.threshold == pytest.approx(2 * lower_median(history + [exact_norm(alone)]))


def test_aggregation_is_deterministic_and_order_free() -> None:
    updates = {"w1": update(1), "w0": scaled(update(0), 50.0), "w2": update(2)}
    first = aggregate(updates, rule(3.0), [1e-3, 2e-3])
    again = aggregate(dict(reversed(list(updates.items()))), rule(3.0), [2e-3, 1e-3])
    assert first.clipped == ["w0"] and first.scales == again.scales
    assert all(torch.equal(first.delta[k], again.delta[k]) for k in first.delta)


def test_the_audit_rederives_the_clipped_round_bit_for_bit() -> None:
    cfg = OuterConfig()
    params, momentum = update(20, 1.0), update(21, 0.1)
    updates = {"w0": update(1), "w1": scaled(update(2), 86.0), "w2": update(3)}
    history = [exact_norm(update(4)), exact_norm(update(5))]
    delta = aggregate(updates, rule(2.0), history).delta
    want_params, want_momentum = outer_step(cfg, params, momentum, delta)
    stored = {w: encode_params(u) for w, u in updates.items()}
    derived = rederive(cfg, encode_params(params), encode_params(outer_state_of(momentum)), stored,
                       rounds=rule(2.0), history=history)
    assert derived.params == encode_params(want_params)
    assert derived.outer_state == encode_params(outer_state_of(want_momentum))
    assert derived.norms == update_norms(stored) == {w: exact_norm(u) for w, u in updates.items()}
    # the plain mean (or another multiple, or no history) gives other bytes: the audit would notice
    for kwargs in ({}, {"rounds": rule(3.0), "history": history}, {"rounds": rule(2.0)}):
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


# ------------------------------------------------------------------------- robust means after the clip


def grid(rows: dict[str, list[float]]) -> dict[str, dict[str, torch.Tensor]]:
    """Updates of one tensor "x", a coordinate per value, by worker."""
    return {w: {"x": torch.tensor(v, dtype=torch.float32)} for w, v in rows.items()}


def test_the_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    # 5 workers, 3 coordinates; β = 0.2: b = 1 value dropped from each end of each coordinate.
    updates = grid({"a": [1.0, 100.0, -3.0], "b": [2.0, 2.0, -1.0], "c": [3.0, 3.0, 50.0],
                    "d": [4.0, -90.0, 0.0], "e": [-70.0, 4.0, 1.0]})
    result = aggregate(updates, rule(0.0, "trimmed_mean", 0.2))
    assert result.trimmed == 1 and result.aggregator == "trimmed_mean"
    # coordinate 0: drop -70 and 4 -> (1+2+3)/3; 1: drop -90 and 100 -> (2+3+4)/3; 2: drop -3, 50 -> (-1+0+1)/3
    assert torch.equal(result.delta["x"], torch.tensor([2.0, 3.0, 0.0]))
    # β = 0.4: b = 2, the middle value alone (here the median too)
    two = aggregate(updates, rule(0.0, "trimmed_mean", 0.4))
    assert two.trimmed == 2 and torch.equal(two.delta["x"], torch.tensor([2.0, 3.0, 0.0]))
    assert torch.equal(two.delta["x"], aggregate(updates, rule(0.0, "median")).delta["x"])


def test_the_trimmed_mean_sums_the_kept_values_in_sorted_order() -> None:
    # 6 workers, b = 1: the kept 4 are added smallest first, one float32 add at a time, then / 4.
    values = [1e8, 1.0, -1e8, 3.0, 7.0, 1e-3]
    result = aggregate(grid({f"w{i}": [v] for i, v in enumerate(values)}), rule(0.0, "trimmed_mean", 0.2))
    kept = [torch.tensor(v, dtype=torch.float32) for v in sorted(values)[1:-1]]
    total = kept[0].clone()
    for t in kept[1:]:
        total = total + t
    assert result.trimmed == 1 and torch.equal(result.delta["x"], (total / 4).reshape(1))


def test_the_median_is_the_lower_middle_value_of_each_coordinate() -> None:
    updates = grid({"a": [5.0, -1.0], "b": [1.0, 8.0], "c": [3.0, 2.0], "d": [4.0, 0.5]})
    # n = 4: the smaller of the two middle values, a value some worker sent
    assert torch.equal(aggregate(updates, rule(0.0, "median")).delta["x"], torch.tensor([3.0, 0.5]))
    odd = {w: u for w, u in updates.items() if w != "d"}
    assert torch.equal(aggregate(odd, rule(0.0, "median")).delta["x"], torch.tensor([3.0, 2.0]))
    pair = {w: u for w, u in updates.items() if w in ("a", "b")}  # n = 2: the coordinate-wise minimum
    assert torch.equal(aggregate(pair, rule(0.0, "median")).delta["x"], torch.tensor([1.0, -1.0]))


def test_a_minority_cannot_move_the_robust_means_out_of_the_honest_range() -> None:
    honest = {f"h{i}": update(i) for i in range(3)}
    stacked = {k: torch.stack([u[k] for u in honest.values()]) for k in honest["h0"]}
    lo = {k: t.min(0).values for k, t in stacked.items()}
    hi = {k: t.max(0).values for k, t in stacked.items()}
    bad = {"m0": scaled(update(10), 1e4), "m1": scaled(update(11), -1e4)}
    for how in (rule(0.0, "median"), rule(0.0, "trimmed_mean", 0.4)):  # n = 5: both tolerate 2
        delta = aggregate({**honest, **bad}, how).delta
        assert all(bool(((delta[k] >= lo[k]) & (delta[k] <= hi[k])).all()) for k in delta), how.aggregator
    plain = aggregate({**honest, **bad}, rule(0.0)).delta  # the mean does not
    assert exact_norm(plain) > 100 * max(exact_norm(u) for u in honest.values())


def test_too_few_updates_to_trim_give_the_mean_bit_for_bit() -> None:
    updates = {f"w{i}": update(i) for i in range(4)}  # β = 0.2: b = ⌊0.8⌋ = 0
    result = aggregate(updates, rule(0.0, "trimmed_mean", 0.2))
    want = mean_pseudo_gradient(updates)
    assert result.trimmed == 0 and all(torch.equal(result.delta[k], want[k]) for k in want)
    assert aggregate(updates, rule(0.0, "trimmed_mean", 0.0)).trimmed == 0
    assert trimmed_count(100, 0.29) == 29 and trimmed_count(5, 0.2) == 1 and trimmed_count(3, 0.34) == 1


def test_the_mean_rule_is_unchanged() -> None:
    updates = {"w1": update(1), "w0": scaled(update(0), 50.0), "w2": update(2)}
    for clip in (0.0, 2.0):
        result = aggregate(updates, rule(clip, "mean"))
        factor = {w: torch.tensor(s, dtype=torch.float32) for w, s in result.scales.items()}
        clipped = {w: {k: v.mul(factor[w]) for k, v in u.items()} if result.scales[w] < 1 else u
                   for w, u in updates.items()}
        want = mean_pseudo_gradient(clipped)
        assert all(torch.equal(result.delta[k], want[k]) for k in want)
        assert result.aggregator == "mean" and result.trimmed == 0
    assert PLAIN_MEAN.clip_multiple == 0 and PLAIN_MEAN.aggregator == "mean"


@pytest.mark.parametrize("aggregator", ["trimmed_mean", "median"])
def test_robust_means_do_not_depend_on_arrival_order_or_threads(aggregator: str) -> None:
    updates = {f"w{i}": scaled(update(i), 10.0 ** (i % 3)) for i in range(7)}
    how = rule(2.0, aggregator, 0.3)
    first = aggregate(updates, how, [1e-3])
    assert first.clipped  # the clip ran first: the ×100 updates entered at most c × the median norm
    for seed in range(3):
        order = torch.randperm(len(updates), generator=torch.Generator().manual_seed(seed)).tolist()
        names = list(updates)
        again = aggregate({names[i]: updates[names[i]] for i in order}, how, [1e-3])
        assert again.scales == first.scales
        assert all(torch.equal(first.delta[k], again.delta[k]) for k in first.delta)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = aggregate(updates, how, [1e-3])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(first.delta[k], single.delta[k]) for k in first.delta)


@pytest.mark.parametrize("aggregator", ["trimmed_mean", "median"])
def test_the_audit_rederives_a_robust_mean_bit_for_bit(aggregator: str) -> None:
    cfg = OuterConfig()
    params, momentum = update(20, 1.0), update(21, 0.1)
    updates = {f"w{i}": update(i) for i in range(5)} | {"m": scaled(update(9), 86.0)}
    how = rule(2.0, aggregator, 0.2)
    want_params, _ = outer_step(cfg, params, momentum, aggregate(updates, how).delta)
    stored = {w: encode_params(u) for w, u in updates.items()}
    start = (encode_params(params), encode_params(outer_state_of(momentum)), stored)
    derived = rederive(cfg, *start, rounds=how)
    assert derived.params == encode_params(want_params)
    assert rederive(cfg, *start, rounds=rule(2.0, "mean")).params != derived.params  # the audit would notice


def test_aggregator_config_is_validated() -> None:
    assert (RunConfig().rounds.aggregator, RunConfig().rounds.trim_fraction) == ("mean", 0.2)
    for name in ("mean", "trimmed_mean", "median"):
        RunConfig(rounds=RoundConfig(aggregator=name))
    for bad in ("Median", "trimmed-mean", "", "krum"):
        with pytest.raises(ConfigError, match="rounds.aggregator .* must be one of mean, trimmed_mean, median"):
            RunConfig(rounds=RoundConfig(aggregator=bad))
    RunConfig(rounds=RoundConfig(trim_fraction=0.0))
    RunConfig(rounds=RoundConfig(trim_fraction=0.49))
    for bad in (0.5, -0.01, 1.0):
        with pytest.raises(ConfigError, match=r"rounds.trim_fraction = .* must be in \[0, 0.5\)"):
            RunConfig(rounds=RoundConfig(trim_fraction=bad))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="rounds.trim_fraction = .* must be a finite number"):
            RunConfig(rounds=RoundConfig(trim_fraction=bad))
    config = RunConfig(rounds=RoundConfig(aggregator="trimmed_mean", trim_fraction=0.25))
    assert RunConfig.from_json(config.to_json()) == config  # travels as the string and the float's repr
    with pytest.raises(ValueError, match="unknown aggregator"):  # an unvalidated section, refused anyway
        aggregate({"w": update(0)}, RoundConfig(aggregator="krum"))


def test_an_attackers_raw_norms_never_reach_the_clip_history() -> None:
    """Each earlier round enters the history as its own lower median ρ̃, so one attacker among two
    cannot raise the threshold of later rounds (raw norms in the history let a ×86 update set half
    of its own threshold and enter at 4.3× the honest norm)."""
    from trainer.rounds.aggregation import round_norm

    honest, attacker = [11.9, 5.5, 5.6], [1023.0, 473.0, 481.6]
    history = [round_norm([h, a]) for h, a in zip(honest[:2], attacker[:2])]
    assert history == honest[:2]  # the smaller of each pair: the honest norm
    rounds = RoundConfig(clip_multiple=2.0)
    g = torch.Generator().manual_seed(0)
    w0 = {"w": torch.randn(64, generator=g)}
    w0 = {"w": w0["w"] * (honest[2] / float(w0["w"].norm()))}
    mallory = {"w": w0["w"] * (attacker[2] / honest[2])}
    out = aggregate({"w0": w0, "mallory": mallory}, rounds, history)
    # R = {5.6, 481.6, 11.9, 5.5}: lower median 5.6, so mallory enters at 2 × 5.6, not 2 × 11.9
    assert out.threshold == pytest.approx(2 * honest[2], rel=1e-6)
    assert out.scales["w0"] == 1.0 and out.clipped == ["mallory"]

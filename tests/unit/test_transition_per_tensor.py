"""The round transition one tensor at a time gives the bits of the whole-dict computation.

``reference_round`` below is the transition as it was written before it went tensor by tensor:
every update clipped whole, Δ⁽ʳ⁾ whole, the outer step on whole dicts, the global update compressed
whole and decoded back from its bytes. ``trainer.rounds.transition.round_transition`` must give the same
parameter, outer-state and downlink bytes, for the three aggregation rules, with clipping, with
updates held as compressed payloads (trainer.rounds.update_source) or as dense dicts, with stage slices,
and with a compressed downlink carrying its error from round to round.
"""

from __future__ import annotations

import math

import pytest
import torch

from proto import Encoding
from trainer.codec import (
    AdaptiveRankPolicy,
    CompressedPayload,
    CompressionConfig,
    ErrorFeedbackCompressor,
    compress,
    decompress,
)
from trainer.codec.downlink import DownlinkCompressor, apply_update, carried_error, global_update
from trainer.codec.wire import Params, ParamsPayload, encode_params, layout_of
from trainer.config import OuterConfig, RoundConfig
from trainer.rounds.aggregation import checked_update, exact_norm, lower_median, trimmed_count, validate_payload
from trainer.rounds.outer import outer_step, zero_momentum
from trainer.rounds.transition import OuterState, TransitionError, round_transition, stored_downlink
from trainer.rounds.update_source import DenseUpdate, MergedUpdate, dense

OUTER = OuterConfig()
RULES = [
    RoundConfig(clip_multiple=0.0),
    RoundConfig(clip_multiple=2.0),
    RoundConfig(clip_multiple=2.0, aggregator="trimmed_mean", trim_fraction=0.2),
    RoundConfig(clip_multiple=1.5, aggregator="median"),
]
RANK = CompressionConfig(enabled=True, min_rank=3, max_rank=3)


def _params(seed: int = 0) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(40, 27, generator=g), "a.bias": torch.randn(27, generator=g),
            "head.weight": torch.randn(33, 3, 5, generator=g) * 0.02, "z.gain": torch.randn(1, generator=g)}


def _updates(round_: int, workers: int) -> dict[str, Params]:
    g = torch.Generator().manual_seed(100 + round_)
    out = {}
    for i in range(workers):
        scale = 1e-3 * (1.0 + i) * (30.0 if i == workers - 1 else 1.0)  # the last one is clipped
        out[f"w{i}"] = {k: scale * torch.randn(v.shape, generator=g) for k, v in _params().items()}
    return out


def _combine_whole(clipped: dict[str, Params], aggregator: str, trim_fraction: float) -> Params:
    workers = sorted(clipped)
    n, b = len(workers), trimmed_count(len(workers), trim_fraction)
    if aggregator == "mean" or (aggregator == "trimmed_mean" and b == 0):
        total = {name: t.clone() for name, t in clipped[workers[0]].items()}
        for w in workers[1:]:
            for name, t in clipped[w].items():
                total[name].add_(t)
        return {name: t.div_(n) for name, t in total.items()}
    out = {}
    for name in clipped[workers[0]]:
        ordered = torch.sort(torch.stack([clipped[w][name] for w in workers]), dim=0, stable=True).values
        if aggregator == "median":
            out[name] = ordered[(n - 1) // 2].clone()
            continue
        total = ordered[b].clone()
        for k in range(b + 1, n - b):
            total.add_(ordered[k])
        out[name] = total.div_(n - 2 * b)
    return out


def reference_round(parent: OuterState, updates: dict[str, Params], rules: RoundConfig, history: list[float],
                    policy: AdaptiveRankPolicy | None) -> tuple[OuterState, bytes | None]:
    """The whole-dict transition (see the module docstring)."""
    norms = {w: exact_norm(u) for w, u in updates.items()}
    clipped = dict(updates)
    if rules.clip_multiple > 0:
        threshold = rules.clip_multiple * lower_median([*norms.values(), *history])
        for w in sorted(updates):
            if norms[w] > threshold:
                factor = torch.tensor(threshold / norms[w], dtype=torch.float32)
                clipped[w] = {name: t.mul(factor) for name, t in updates[w].items()}
    delta = _combine_whole(clipped, rules.aggregator, rules.trim_fraction)
    target, momentum = outer_step(OUTER, parent.params, parent.momentum, delta)
    if policy is None:
        return OuterState(target, momentum), None
    u = global_update(parent.params, target)
    payload, header = compress(u, dict(parent.downlink_error), policy)
    received = decompress(payload, header, layout_of(parent.params))
    error = carried_error(u, parent.downlink_error, received)
    return OuterState(apply_update(parent.params, received), momentum, error), payload


def _compressed(updates: dict[str, Params]) -> dict[str, CompressedPayload]:
    """Each update as a worker sends it (rank 3, int4/int8) and the coordinator holds it."""
    out = {}
    for w, u in updates.items():
        payload, header, _ = ErrorFeedbackCompressor(AdaptiveRankPolicy(RANK)).compress(u)
        out[w] = CompressedPayload.parse(payload, header, layout_of(u))
    return out


def _same(a: OuterState, b: OuterState) -> bool:
    return a.params_bytes() == b.params_bytes() and a.outer_state_bytes() == b.outer_state_bytes()


@pytest.mark.parametrize("rules", RULES, ids=lambda r: f"{r.aggregator}-clip{r.clip_multiple:g}")
@pytest.mark.parametrize("held", ["dense", "compressed"])
@pytest.mark.parametrize("downlink", [False, True])
def test_per_tensor_rounds_give_the_whole_dict_bits(rules: RoundConfig, held: str, downlink: bool) -> None:
    state = ref = OuterState(_params(), zero_momentum(_params()))
    encoder = DownlinkCompressor(AdaptiveRankPolicy(RANK)) if downlink else None
    policy = AdaptiveRankPolicy(RANK) if downlink else None
    history: list[float] = []
    clipped_seen = False
    for r in range(1, 4):  # the second and third rounds start from a carried downlink error
        updates = _updates(r, 5)
        sources = _compressed(updates) if held == "compressed" else updates
        as_dense = {w: dense(s) for w, s in sources.items()}
        result = round_transition(state, sources, outer=OUTER, rounds=rules, history=history, downlink=encoder)
        ref, ref_payload = reference_round(ref, as_dense, rules, history, policy)
        assert _same(result.state, ref), f"round {r}"
        assert (result.downlink.payload if result.downlink else None) == ref_payload
        assert result.aggregated.norms == {w: exact_norm(u) for w, u in as_dense.items()}
        clipped_seen = clipped_seen or bool(result.aggregated.clipped)
        history = [lower_median(list(result.aggregated.norms.values()))]
        state = result.state
    assert clipped_seen == (rules.clip_multiple > 0)
    if downlink:
        assert state.downlink_error and set(state.downlink_error) == set(state.params)


def test_the_audits_stored_downlink_gives_the_coordinators_bits_and_refuses_a_wrong_layout() -> None:
    parent = OuterState(_params(), zero_momentum(_params()))
    updates = _compressed(_updates(1, 3))
    made = round_transition(parent, updates, outer=OUTER, rounds=RULES[1],
                            downlink=DownlinkCompressor(AdaptiveRankPolicy(RANK)))
    assert made.downlink is not None
    again = round_transition(parent, updates, outer=OUTER, rounds=RULES[1],
                             downlink=stored_downlink(made.downlink.payload, made.downlink.header))
    assert _same(made.state, again.state)
    other = {name: t for name, t in _params().items() if name != "z.gain"}
    smaller = OuterState(other, zero_momentum(other))
    with pytest.raises(TransitionError, match="compressed global update: tensor z.gain"):
        round_transition(smaller, {w: {n: t for n, t in dense(s).items() if n != "z.gain"} for w, s in updates.items()},
                         outer=OUTER, rounds=RULES[1], downlink=stored_downlink(made.downlink.payload,
                                                                                made.downlink.header))


def test_releasing_the_parent_gives_the_same_bits_and_empties_its_outer_state() -> None:
    """The coordinator's close (release_parent, params_into): m⁽ʳ⁻¹⁾ and e⁽ʳ⁻¹⁾ are taken out as they
    are used, θ⁽ʳ⁻¹⁾ stays, θ⁽ʳ⁾ is written into its serialisation and held as views of it, and the
    child is the pure transition's, bit for bit, two rounds running (the second with a carried
    downlink error)."""
    kept, released = (OuterState(_params(), zero_momentum(_params())) for _ in range(2))
    encoders = [DownlinkCompressor(AdaptiveRankPolicy(RANK)) for _ in range(2)]
    for r in (1, 2):
        updates = _compressed(_updates(r, 3))
        pure = round_transition(kept, updates, outer=OUTER, rounds=RULES[1], downlink=encoders[0])
        theta = dict(released.params)
        into = ParamsPayload(layout_of(theta))
        freed = round_transition(released, updates, outer=OUTER, rounds=RULES[1], downlink=encoders[1],
                                 release_parent=True, params_into=into)
        assert _same(pure.state, freed.state) and pure.downlink == freed.downlink
        assert into.payload() == pure.state.params_bytes()
        base = torch.frombuffer(into.buffer, dtype=torch.uint8).data_ptr()
        for name, t in freed.state.params.items():  # views of the serialisation, not copies
            assert base < t.data_ptr() < base + len(into.buffer), name
        assert not released.momentum and not released.downlink_error
        assert released.params.keys() == theta.keys() and all(released.params[n] is t for n, t in theta.items())
        assert kept.momentum
        kept, released = pure.state, freed.state


def test_stage_slices_held_apart_give_the_bits_of_the_merged_update() -> None:
    parent = OuterState(_params(), zero_momentum(_params()))
    updates = _updates(2, 3)
    slices = {w: MergedUpdate([DenseUpdate({n: u[n] for n in ("a.bias", "a.weight")}),
                               DenseUpdate({n: u[n] for n in ("head.weight", "z.gain")})]) for w, u in updates.items()}
    whole = round_transition(parent, updates, outer=OUTER, rounds=RULES[2])
    apart = round_transition(parent, slices, outer=OUTER, rounds=RULES[2])
    assert _same(whole.state, apart.state)
    with pytest.raises(ValueError, match="in two stage slices"):
        MergedUpdate([DenseUpdate({"x": torch.ones(1)}), DenseUpdate({"x": torch.ones(1)})])


def test_a_failed_round_leaves_the_downlink_policy_as_it_was() -> None:
    parent = OuterState(_params(), zero_momentum(_params()))
    encoder = DownlinkCompressor(AdaptiveRankPolicy(CompressionConfig(enabled=True, min_rank=2, max_rank=8)))
    before = encoder.policy.state_dict()
    updates = _updates(1, 2)
    updates["w0"]["z.gain"] = torch.tensor([math.inf])  # the last tensor: the others were encoded first
    with pytest.raises(ArithmeticError, match="made z.gain non-finite"):
        round_transition(parent, updates, outer=OUTER, rounds=RULES[0], downlink=encoder)
    after = encoder.policy.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_checked_push_is_held_compact_with_its_exact_norm() -> None:
    u = _updates(3, 1)["w0"]
    payload, header, _ = ErrorFeedbackCompressor(AdaptiveRankPolicy(RANK)).compress(u)
    checked = checked_update(payload, layout_of(u), bound=1e9, encoding=Encoding.LOWRANK_INT4, codec_header=header)
    whole = decompress(payload, header, layout_of(u))
    assert isinstance(checked.source, CompressedPayload)
    assert checked.source.nbytes < len(payload) < len(encode_params(whole))
    assert checked.norm == exact_norm(whole) and math.isfinite(checked.norm)
    held = dense(checked.source)
    assert all(torch.equal(held[n], whole[n]) for n in whole)
    assert all(torch.equal(a, b) for a, b in zip(validate_payload(encode_params(whole), layout_of(whole), 1e9).values(),
                                                 [whole[n] for n in sorted(whole)]))


def test_exact_norm_in_integers_is_math_fsum_of_the_exact_squares() -> None:
    def fsum_of_squares(t: torch.Tensor) -> float:
        return math.fsum(t.reshape(-1).double().square().tolist())

    g = torch.Generator().manual_seed(5)
    cases = [torch.tensor([2.0 ** -149, 1e-45, 3e-42, 0.0, -0.0, 1.17e-38, 3.4e38, -3.4e38]),
             torch.zeros(3), torch.randn(9, 9, generator=g).to(torch.bfloat16), torch.randn(7, generator=g).half(),
             torch.randn(64, 64, generator=g) * 4e-4, torch.tensor([1.0, math.inf]), torch.tensor([math.nan])]
    for _ in range(100):  # values spread over most of float32's exponent range
        n = int(torch.randint(1, 300, (1,), generator=g))
        cases.append(torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 25))
    for t in cases:
        got, want = exact_norm({"t": t}), math.sqrt(fsum_of_squares(t))
        assert got == want or (math.isnan(got) and math.isnan(want)), t[:4]

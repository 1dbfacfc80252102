"""The top-k + int4 codec (trainer.codec.topk, framed by trainer.codec): what it keeps, that it
decodes to the same bits, that error feedback loses nothing, and that a hostile header or payload
is refused naming the tensor and field."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from trainer.codec import (
    AdaptiveRankPolicy,
    CompressionConfig,
    CompressionError,
    ErrorFeedbackCompressor,
    accumulate,
    compressed_size,
    decompress,
    density_matching_bytes,
    predicted_size,
    topk,
)
from trainer.codec.wire import decode_params, encode_params, layout_of

CONFIG = CompressionConfig(enabled=True, codec="topk", topk_density=0.05, topk_chunk=1000, int4_group_size=64)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 50, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(9, 11, generator=g)}


def compress(t: dict[str, torch.Tensor], config: CompressionConfig = CONFIG):
    payload, header, _ = ErrorFeedbackCompressor(AdaptiveRankPolicy(config)).compress(t)
    return payload, header


def test_it_keeps_the_largest_entries_of_every_chunk_and_decodes_them_exactly() -> None:
    t = tensors()
    payload, header = compress(t)
    out = decompress(payload, header, layout_of(t))
    a = t["a.weight"].reshape(-1).double()
    got = out["a.weight"].reshape(-1)
    counts = topk.kept_counts(a.numel(), 1000, 50)
    assert counts == [50, 50, 50, 10] and int((got != 0).sum()) == sum(counts)  # 3,200 values: 3 full chunks + 200
    for start, kept in zip(range(0, a.numel(), 1000), counts):
        chunk, sent = a[start:start + 1000], got[start:start + 1000]
        threshold = chunk.abs().sort(descending=True).values[kept - 1]
        assert bool((chunk[sent != 0].abs() >= threshold).all())  # exactly the top |A| of the chunk
        # int4 values: within half a scale, a scale being at most max|A| / 7
        assert float((sent[sent != 0].double() - chunk[sent != 0]).abs().max()) <= float(a.abs().max()) / 14 + 1e-7
    assert torch.equal(decompress(payload, header, layout_of(t))["a.weight"], out["a.weight"])  # same bits
    assert compressed_size(header) == predicted_size(layout_of(t), CONFIG)


def test_its_round_decision_says_no_rank_was_chosen() -> None:
    policy = AdaptiveRankPolicy(CONFIG)
    ErrorFeedbackCompressor(policy).compress(tensors())
    assert policy.last_decision is not None and policy.last_decision.describe() == "no rank chosen"
    low_rank = AdaptiveRankPolicy(CompressionConfig(enabled=True, min_rank=2, max_rank=2, int4_group_size=64))
    ErrorFeedbackCompressor(low_rank).compress(tensors())
    assert low_rank.last_decision is not None and low_rank.last_decision.describe().startswith("mean rank 2.0, energy ")


def test_ties_go_to_the_lower_position() -> None:
    local, flat = topk.select(torch.ones(10, dtype=torch.float64), chunk=5, k=2)
    assert local.tolist() == [0, 1, 0, 1] and flat.tolist() == [0, 1, 5, 6]


def test_error_feedback_sends_everything_eventually() -> None:
    """Σ sent + final residual = Σ Δ over rounds (float64 sums of float32 terms)."""
    comp = ErrorFeedbackCompressor(AdaptiveRankPolicy(CONFIG))
    total = torch.zeros(64, 50, dtype=torch.float64)
    sent = torch.zeros_like(total)
    for seed in range(6):
        delta = tensors(seed)
        total += delta["a.weight"].double()
        payload, header, _ = comp.compress(delta)
        sent += decompress(payload, header, layout_of(delta))["a.weight"].double()
    assert torch.allclose(sent + comp.errors["a.weight"].double(), total, atol=1e-5)


def test_equal_bytes_density_matches_the_low_rank_payload() -> None:
    layout = {"w": ("float32", (256, 512)), "v": ("float32", (512,))}
    lowrank = CompressionConfig(enabled=True, min_rank=8, max_rank=8, int4_group_size=128)
    target = predicted_size(layout, lowrank)
    density = density_matching_bytes(layout, target, CompressionConfig(codec="topk", int4_group_size=128))
    at = predicted_size(layout, CompressionConfig(codec="topk", topk_density=density, int4_group_size=128))
    above = predicted_size(layout, CompressionConfig(codec="topk", topk_density=density + 1 / 4096, int4_group_size=128))
    assert at <= target < above


def tamper(payload: bytes, header: dict, name: str, key: str, fn) -> tuple[bytes, dict]:
    packed = decode_params(payload)
    packed[key] = fn(packed[key].clone())
    return encode_params(packed), header


@pytest.mark.parametrize("what, change, message", [
    ("k above the chunk", lambda h, p: (h["tensors"][0].update(k=1001), p), "field k"),
    ("chunk too large", lambda h, p: (h["tensors"][0].update(chunk=70_000), p), "field chunk"),
    ("a rank", lambda h, p: (h["tensors"][0].update(rank=3), p), "field rank"),
    ("fewer kept values", lambda h, p: (h["tensors"][0].update(k=49), p), "field I.shape"),
])
def test_hostile_headers_are_refused(what: str, change, message: str) -> None:
    t = tensors()
    payload, header = compress(t)
    header = copy.deepcopy(header)
    change(header, payload)
    with pytest.raises(CompressionError, match=message):
        decompress(payload, header, layout_of(t))


def _swap_first_two(q: torch.Tensor) -> torch.Tensor:
    q[[0, 1, 2, 3]] = q[[2, 3, 0, 1]]
    return q


def _repeat_first(q: torch.Tensor) -> torch.Tensor:
    q[2:4] = q[0:2]
    return q


def _out_of_chunk(q: torch.Tensor) -> torch.Tensor:
    q[-2:] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)  # position 65535 in a 200-value chunk
    return q


@pytest.mark.parametrize("key, fn, message", [
    ("a.weight.I.q", _swap_first_two, "not strictly increasing"),
    ("a.weight.I.q", _repeat_first, "not strictly increasing"),
    ("a.weight.I.q", _out_of_chunk, "outside its chunk"),
    ("a.weight.V.scale", lambda s: s.fill_(float("nan")), "non-finite"),
    ("a.weight.V.scale", lambda s: s.neg_(), "negative"),
    ("a.weight.I.q", lambda q: q[:-2], "header implies"),
])
def test_hostile_payloads_are_refused(key: str, fn, message: str) -> None:
    t = tensors()
    payload, header = compress(t)
    bad, header = tamper(payload, header, "a.weight", key, fn)
    with pytest.raises(CompressionError, match=message) as caught:
        decompress(bad, header, layout_of(t))
    assert "a.weight" in str(caught.value)


@pytest.mark.parametrize("field, value", [("codec", "zip"), ("topk_density", 0.0), ("topk_density", 1.5),
                                          ("topk_chunk", 0), ("topk_chunk", 70_000), ("error_decay", -0.1),
                                          ("error_decay", 1.5)])
def test_config_refuses_out_of_range_settings(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CompressionConfig(**{field: value})


def test_error_decay_carries_beta_e_into_the_next_round() -> None:
    """A = Δ + β·e, e ← A − Â (trainer.codec.feedback); β = 1 is the plain feedback, bit for bit."""
    beta = 0.75
    decayed = ErrorFeedbackCompressor(AdaptiveRankPolicy(replace(CONFIG, error_decay=beta)))
    plain = ErrorFeedbackCompressor(AdaptiveRankPolicy(CONFIG))
    first, second = tensors(0), tensors(1)
    for comp in (decayed, plain):
        comp.compress(first)
    e1 = {name: e.clone() for name, e in decayed.errors.items()}
    assert all(torch.equal(e1[n], plain.errors[n]) for n in e1)  # round 1: no buffer yet, β plays no part
    payload, header, _ = decayed.compress(second)
    sent = decompress(payload, header, layout_of(second))
    for name, delta in second.items():
        a = delta.double() + beta * e1[name].double()
        assert torch.equal(decayed.errors[name], (a - sent[name].double()).float()), name
        assert torch.equal(accumulate(delta, e1[name], beta), a)
    plain_payload, _, _ = plain.compress(second)
    for name, delta in second.items():  # β = 1: e added unscaled
        assert torch.equal(accumulate(delta, e1[name]), delta.double() + e1[name].double())
    assert payload != plain_payload


def test_the_union_downlink_keeps_w_times_k_per_chunk() -> None:
    """With topk_downlink_union the broadcast holds every position of the average of W top-k updates."""
    config = replace(CONFIG, topk_downlink_union=True)
    k = topk.keep_per_chunk(config.topk_density, config.topk_chunk)
    for workers in (1, 2, 3, 50):
        down = config.downlink(workers)
        assert topk.keep_per_chunk(down.topk_density, down.topk_chunk) == min(config.topk_chunk, workers * k)
    assert CONFIG.downlink(2) == CONFIG  # off: the uplink's k
    lowrank = CompressionConfig(enabled=True, topk_downlink_union=True)
    assert lowrank.downlink(2) == lowrank  # a top-k setting only


def test_the_new_settings_keep_old_configurations_cids() -> None:
    from trainer.config import RunConfig

    text = json.dumps(RunConfig().to_json())
    assert "error_decay" not in text and "topk_downlink_union" not in text
    assert "error_decay" in json.dumps(replace(RunConfig(), compression=replace(CONFIG, error_decay=0.9)).to_json())

"""Low-rank + int4 compression with error feedback: packing, error bounds, feedback, adaptive rank,
determinism, validation of what arrives, and the compression ratio."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from trainer.codec import (
    AdaptiveRankPolicy,
    CompressionConfig,
    CompressionError,
    ErrorFeedbackCompressor,
    compress,
    compressed_size,
    decompress,
    frame,
    lowrank,
    pack_int4,
    quant,
    unpack_int4,
)
from trainer.codec.wire import layout_of


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def low_rank_plus_noise(m: int, n: int, rank: int, noise: float, seed: int) -> torch.Tensor:
    g = gen(seed)
    a = torch.randn(m, rank, generator=g, dtype=torch.float64)
    b = torch.randn(rank, n, generator=g, dtype=torch.float64)
    return (a @ b + noise * torch.randn(m, n, generator=g, dtype=torch.float64)).float()


# ------------------------------------------------------------------------------------- packing


def test_pack_all_sixteen_values_and_nibble_order() -> None:
    values = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_int4(packed, 16), values)
    # two's complement, low nibble first: (1, -1) -> 0x1 | 0xF << 4
    assert pack_int4(torch.tensor([1, -1])).tolist() == [0xF1]
    assert pack_int4(torch.tensor([-8, 7])).tolist() == [0x78]


@pytest.mark.parametrize("count", [0, 1, 3, 17, 10_001])
def test_pack_round_trip_odd_lengths_and_random(count: int) -> None:
    values = torch.randint(-8, 8, (count,), generator=gen(count), dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.numel() == (count + 1) // 2
    assert torch.equal(unpack_int4(packed, count), values)
    if count % 2:
        assert int(packed[-1]) >> 4 == 0  # padding nibble is zero


def test_pack_refuses_out_of_range_and_unpack_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([8]))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([-9]))
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_int4(torch.zeros(3, dtype=torch.uint8), 7)


# ------------------------------------------------------------------------- reconstruction bound


def quantisation_radius(scales: torch.Tensor, numel: int, group: int) -> float:
    """sqrt(Σ_groups n_g (s_g/2)²): the largest ‖x − deq(q(x))‖_F the scales allow."""
    sizes = torch.full((scales.numel(),), float(group), dtype=torch.float64)
    if numel % group:
        sizes[-1] = numel % group
    return math.sqrt(float((sizes * (scales.double() / 2) ** 2).sum()))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(128, 96, generator=gen(3)), id="random"),
        pytest.param(lambda: low_rank_plus_noise(128, 96, 6, 0.05, seed=4), id="low-rank-plus-noise"),
        pytest.param(lambda: low_rank_plus_noise(30, 200, 3, 0.01, seed=5), id="wide-partial-groups"),
    ],
)
@pytest.mark.parametrize("rank", [4, 8])
def test_lowrank_error_within_svd_tail_plus_quantisation_bound(make, rank: int) -> None:
    """‖A − Â‖_F ≤ sqrt(Σ_{i>r} σᵢ²) + √σ₁ (ε_P + ε_Q) + ε_P ε_Q  (+ float32 rounding).

    Derivation. A_r = P Qᵀ with P = U_r Σ_r^{1/2}, Q = V_r Σ_r^{1/2}, and ‖A − A_r‖_F =
    sqrt(Σ_{i>r} σᵢ²) (Eckart–Young). Write P̃ = P + E_P, Q̃ = Q + E_Q for the dequantised factors:

        P̃ Q̃ᵀ − P Qᵀ = E_P Qᵀ + P E_Qᵀ + E_P E_Qᵀ,
        ‖·‖_F ≤ ‖E_P‖_F ‖Q‖₂ + ‖P‖₂ ‖E_Q‖_F + ‖E_P‖_F ‖E_Q‖_F        (‖XY‖_F ≤ ‖X‖_F ‖Y‖₂)

    with ‖P‖₂ = ‖Q‖₂ = √σ₁. Each value is off by at most half its group's step, |E_j| ≤ s_g/2, so
    ‖E_P‖_F ≤ ε_P = sqrt(Σ_g n_g (s_g/2)²) from the scales actually sent (n_g values in group g).
    The triangle inequality adds the two terms. The final rounding of Â to float32 adds at most
    2⁻²⁴ ‖Â‖_F, covered by a relative slack of 1e-6.
    """
    a = make()
    m, n = a.shape
    payload, header = compress({"w": a}, None, AdaptiveRankPolicy.fixed(rank))
    (entry,) = header["tensors"]
    assert entry["kind"] == "lowrank-int4" and entry["rank"] == rank
    group = entry["group_size"]
    sent = st_load(payload)
    eps_p = quantisation_radius(sent["w.P.scale"], m * rank, group)
    eps_q = quantisation_radius(sent["w.Q.scale"], n * rank, group)
    sigma = torch.linalg.svdvals(a.double())
    tail = math.sqrt(float((sigma[rank:] ** 2).sum()))
    bound = tail + math.sqrt(float(sigma[0])) * (eps_p + eps_q) + eps_p * eps_q
    a_hat = decompress(payload, header, layout_of({"w": a}))["w"]
    err = float((a.double() - a_hat.double()).norm())
    norm = float(a.double().norm())
    print(f"{m}x{n} rank {rank}: ‖A−Â‖/‖A‖ = {err / norm:.4f}, bound/‖A‖ = {bound / norm:.4f}, "
          f"SVD tail/‖A‖ = {tail / norm:.4f}")
    assert err <= bound * (1 + 1e-6) + 1e-6 * norm
    assert err >= tail * (1 - 1e-6)  # nothing beats the truncated SVD
    if tail < 0.05 * norm:  # on (nearly) rank-r data the bound says something: well below ‖A‖
        assert bound < 0.6 * norm


def test_lowrank_relative_error_on_low_rank_data() -> None:
    a = low_rank_plus_noise(128, 96, 6, 0.01, seed=6)
    payload, header = compress({"w": a}, None, AdaptiveRankPolicy.fixed(6))
    a_hat = decompress(payload, header, layout_of({"w": a}))["w"]
    relative = float((a - a_hat).norm() / a.norm())
    print(f"rank-6 + 1% noise, 128x96, rank 6: relative error {relative:.4f}")
    assert relative < 0.15  # int4 factors: about 1/7 of a group's max, halved, per entry


@pytest.mark.parametrize("shape, kind, qmax", [((12, 10), "int4", 7), ((1000,), "int8", 127), ((), "int8", 127)])
def test_dense_kinds_error_within_half_step(shape, kind: str, qmax: int) -> None:
    a = torch.randn(shape, generator=gen(7)) * 3
    payload, header = compress({"t": a}, None, AdaptiveRankPolicy.fixed(8))
    (entry,) = header["tensors"]
    assert entry["kind"] == kind
    scales = st_load(payload)["t.W.scale"]
    eps = quantisation_radius(scales, a.numel(), entry["group_size"])
    a_hat = decompress(payload, header, layout_of({"t": a}))["t"]
    assert a_hat.shape == a.shape
    assert float((a.double() - a_hat.double()).norm()) <= eps * (1 + 1e-6) + 1e-7
    # each scale is its group's max |x| / qmax
    flat = a.reshape(-1).double()
    g = entry["group_size"]
    expected = torch.stack([flat[i:i + g].abs().max() / qmax for i in range(0, flat.numel(), g)])
    assert torch.equal(scales, expected.float())


def test_kind_rules_and_size_accounting() -> None:
    tensors = {
        "bias": torch.randn(64, generator=gen(8)),               # 1-D -> int8
        "small": torch.randn(10, 12, generator=gen(9)),          # r = 8 >= min/2 = 5 -> int4
        "conv": torch.randn(40, 4, 3, 3, generator=gen(10)),     # flattened to 40 x 36 -> low rank
        "tiny": torch.randn(1, 50, generator=gen(11)),           # min = 1: never worth an SVD
    }
    policy = AdaptiveRankPolicy.fixed(8)
    payload, header = compress(tensors, None, policy)
    kinds = {e["name"]: e["kind"] for e in header["tensors"]}
    assert kinds == {"bias": "int8", "small": "int4", "conv": "lowrank-int4", "tiny": "int4"}
    conv = next(e for e in header["tensors"] if e["name"] == "conv")
    assert conv["parts"]["P"]["shape"] == [40, 8] and conv["parts"]["Q"]["shape"] == [36, 8]
    assert sorted(policy.last_decision.tensors) == ["conv"]  # "small": r_min >= min/2, no SVD
    data = sum(t.numel() * t.element_size() for t in st_load(payload).values())
    assert compressed_size(header) == data
    out = decompress(payload, header, layout_of(tensors))
    assert {k: (v.dtype, v.shape) for k, v in out.items()} == {k: (v.dtype, v.shape) for k, v in tensors.items()}


# ------------------------------------------------------------------------------ error feedback


def test_error_feedback_keeps_accumulated_error_bounded() -> None:
    m, n, rounds = 64, 48, 50
    layout = {"w": ("float32", (m, n))}

    def run(feedback: bool) -> list[float]:
        policy = AdaptiveRankPolicy.fixed(4)
        errors: dict[str, torch.Tensor] | None = {} if feedback else None
        g = gen(12)
        sent = torch.zeros(m, n, dtype=torch.float64)
        true = torch.zeros(m, n, dtype=torch.float64)
        gaps = []
        for _ in range(rounds):
            delta = torch.randn(m, n, generator=g)
            payload, header = compress({"w": delta}, errors, policy)
            sent += decompress(payload, header, layout)["w"].double()
            true += delta.double()
            gaps.append(float((sent - true).norm()))
            if errors is not None:
                # Σ transmitted − Σ Δ = −e_T (telescoping), up to float32 storage of e
                assert gaps[-1] == pytest.approx(float(errors["w"].double().norm()), rel=1e-5)
        return gaps

    with_feedback, without = run(True), run(False)
    print(f"‖Σ sent − Σ Δ‖ at T=5,25,50: with feedback {with_feedback[4]:.1f}, "
          f"{with_feedback[24]:.1f}, {with_feedback[49]:.1f}; without {without[4]:.1f}, "
          f"{without[24]:.1f}, {without[49]:.1f} (‖Δ‖ ≈ {math.sqrt(m * n):.1f})")
    # bounded: the second half never exceeds the first half's level by more than 25 %
    assert max(with_feedback[25:]) <= 1.25 * max(with_feedback[10:25])
    # without feedback the dropped components add up like a random walk (~ √T)
    assert without[-1] >= 2.5 * without[4]
    assert with_feedback[-1] <= 0.5 * without[-1]


def test_compress_refuses_bad_input_and_leaves_state_untouched() -> None:
    policy = AdaptiveRankPolicy.fixed(2)
    errors: dict[str, torch.Tensor] = {}
    compress({"w": torch.randn(8, 8, generator=gen(13))}, errors, policy)
    before = errors["w"].clone()
    state = policy.state_dict()
    bad = torch.randn(8, 8, generator=gen(14))
    bad[3, 3] = float("nan")
    with pytest.raises(CompressionError, match="tensor w: values are not all finite"):
        compress({"w": bad}, errors, policy)
    with pytest.raises(CompressionError, match="tensor i: dtype int64"):
        compress({"i": torch.ones(3, dtype=torch.int64)}, errors, policy)
    assert torch.equal(errors["w"], before)
    assert policy.round == 1 and all(torch.equal(v, state[k]) for k, v in policy.state_dict().items())


# ------------------------------------------------------------------------------- adaptive rank


def concentrating_stream(rounds: int, m: int = 96, n: int = 64, seed: int = 15):
    """Updates whose spectrum decays faster every round: σᵢ = exp(−i/ℓ_t), ℓ from 16 to 0.5."""
    g = gen(seed)
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    for t in range(rounds):
        ell = 16.0 * 0.5 ** (t / 6)
        s = torch.exp(-torch.arange(n, dtype=torch.float64) / ell)
        noise = 1e-3 * torch.randn(m, n, generator=g, dtype=torch.float64)
        yield {"w": ((u * s) @ v.T + noise).float(), "b": torch.randn(n, generator=g)}


def test_adaptive_rank_decreases_as_energy_concentrates() -> None:
    cfg = CompressionConfig(target_energy=0.9, min_rank=2, max_rank=24, window=3, max_rank_factor=2.0)
    compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(cfg))
    ranks, sizes = [], []
    for t, update in enumerate(concentrating_stream(30)):
        payload, header, decision = compressor.compress(update)
        assert decision.round == t + 1 and set(decision.tensors) == {"w"}  # "b" is int8, no rank
        d = decision.tensors["w"]
        assert cfg.min_rank <= d.rank <= cfg.max_rank
        if not ranks:  # first round: only the [r_min, r_max] clamp applies
            assert d.rank == min(cfg.max_rank, max(cfg.min_rank, d.target_rank))
        if d.rank < cfg.max_rank:
            assert d.window_energy >= cfg.target_energy - 1e-9  # the reported energy reached τ
        assert 0.0 < d.energy <= 1.0 and d.total_energy > 0
        entry = next(e for e in header["tensors"] if e["name"] == "w")
        assert entry["rank"] == d.rank  # the header sends what the decision says
        if ranks:
            assert ranks[-1] / cfg.max_rank_factor <= d.rank <= ranks[-1] * cfg.max_rank_factor
        ranks.append(d.rank)
        sizes.append(len(payload))
        log = decision.as_dict()
        assert log["tensors"]["w"]["rank"] == d.rank and 0 < log["energy"] <= 1
    print(f"ranks over 30 rounds: {ranks}; payload bytes {sizes[0]} -> {sizes[-1]}")
    assert ranks[-1] <= ranks[0] // 3
    assert all(b <= a for a, b in zip(ranks[8:], ranks[9:]))  # non-increasing once it has turned
    assert sizes[-1] < sizes[0]


def test_the_rank_follows_the_update_not_the_residual_error_feedback_adds() -> None:
    """A rank-3 update under a large, flat error buffer: the policy reads Δ's spectrum (three
    directions hold τ of it), while A = Δ + e's would need most of the 48; what is dropped stays in e."""
    cfg = CompressionConfig(target_energy=0.9, min_rank=1, max_rank=40, window=1)
    update = low_rank_plus_noise(64, 48, 3, 0.0, seed=1)
    residual = 3.0 * update.norm() / 48 * torch.randn(64, 48, generator=gen(2))
    errors = {"w": residual.clone()}
    policy = AdaptiveRankPolicy(cfg)
    payload, header = compress({"w": update}, errors, policy)
    d = policy.last_decision.tensors["w"]
    assert d.target_rank == 3 and d.rank == 3 and d.energy >= 0.9
    a = update.double() + residual.double()  # what the rule before read: σ of A
    curve = torch.cumsum(lowrank.singular_values(a) ** 2, 0) / (a.norm() ** 2)
    assert int(torch.nonzero(curve >= 0.9)[0]) + 1 > 20
    sent = decompress(payload, header, {"w": ("float32", (64, 48))})["w"]
    torch.testing.assert_close(errors["w"].double(), a - sent.double(), rtol=0, atol=1e-5)  # e ← A − Â


def test_singular_values_match_lapack() -> None:
    a = low_rank_plus_noise(40, 70, 5, 0.1, seed=3).double()
    torch.testing.assert_close(lowrank.singular_values(a), torch.linalg.svdvals(a), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lowrank.singular_values(a.T), torch.linalg.svdvals(a), rtol=1e-9, atol=1e-9)


def test_rank_changes_by_at_most_the_factor_per_round() -> None:
    cfg = CompressionConfig(target_energy=0.95, min_rank=1, max_rank=32, window=1, max_rank_factor=2.0)
    policy = AdaptiveRankPolicy(cfg)
    flat = torch.ones(48, dtype=torch.float64)             # needs ~46 of 48 directions
    spike = torch.tensor([1.0] + [1e-6] * 47, dtype=torch.float64)  # one direction suffices
    ranks = [policy.decide("w", flat, (64, 48)).rank]
    for _ in range(6):
        d = policy.decide("w", spike, (64, 48))
        assert d.target_rank == 1
        ranks.append(d.rank)
    assert ranks == [32, 16, 8, 4, 2, 1, 1]
    ranks = [policy.decide("w", flat, (64, 48)).rank for _ in range(6)]
    assert ranks == [2, 4, 8, 16, 32, 32]
    policy.finish_round()
    assert policy.last_decision is not None and policy.last_decision.tensors["w"].rank == 32


def test_zero_update_needs_no_rank() -> None:
    policy = AdaptiveRankPolicy(CompressionConfig(min_rank=2, max_rank=16))
    payload, header = compress({"w": torch.zeros(64, 64)}, {}, policy)
    assert policy.last_decision.tensors["w"].rank == 2
    out = decompress(payload, header, {"w": ("float32", (64, 64))})
    assert torch.equal(out["w"], torch.zeros(64, 64))


def test_compressor_state_round_trips_through_safetensors() -> None:
    cfg = CompressionConfig(target_energy=0.9, min_rank=2, max_rank=24, window=3)
    stream = list(concentrating_stream(8))
    original = ErrorFeedbackCompressor(AdaptiveRankPolicy(cfg))
    for update in stream[:4]:
        original.compress(update)
    saved = st_save(original.state_dict())
    resumed = ErrorFeedbackCompressor(AdaptiveRankPolicy(cfg))
    resumed.load_state_dict(st_load(saved))
    for update in stream[4:]:
        a, ha, da = original.compress(update)
        b, hb, db = resumed.compress(update)
        assert a == b and ha == hb and da.as_dict() == db.as_dict()
    with pytest.raises(CompressionError, match="unexpected entry"):
        resumed.load_state_dict({**resumed.state_dict(), "junk": torch.zeros(1)})


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_rank"):
        CompressionConfig(min_rank=8, max_rank=4)
    with pytest.raises(ValueError, match="target_energy"):
        CompressionConfig(target_energy=1.5)
    with pytest.raises(ValueError, match="max_rank_factor"):
        CompressionConfig(max_rank_factor=0.5)


# ------------------------------------------------------------------------------- determinism


def test_same_inputs_give_identical_bytes_and_tensors() -> None:
    tensors = {"w": low_rank_plus_noise(96, 80, 5, 0.1, seed=16), "b": torch.randn(80, generator=gen(17))}
    errors = {"w": 0.01 * torch.randn(96, 80, generator=gen(18))}
    runs = []
    for _ in range(2):
        e = {k: v.clone() for k, v in errors.items()}
        runs.append((*compress(tensors, e, AdaptiveRankPolicy(CompressionConfig(max_rank=16))), e))
    (p1, h1, e1), (p2, h2, e2) = runs
    assert p1 == p2 and h1 == h2 and all(torch.equal(e1[k], e2[k]) for k in e1)

    layout = layout_of(tensors)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = decompress(p1, h1, layout)
    finally:
        torch.set_num_threads(threads)
    again = decompress(p1, copy.deepcopy(h1), layout)
    assert all(torch.equal(single[k], again[k]) for k in tensors)
    # the worker's residual is computed from exactly what the receivers rebuild
    a = tensors["w"].double() + errors["w"].double()
    assert torch.equal(e1["w"], (a - again["w"].double()).float())


@pytest.mark.parametrize("m, n, r", [(1, 1, 1), (97, 5000, 3), (4100, 7, 9), (300, 301, 17)])
def test_reconstruction_adds_the_rank_one_terms_in_order(m: int, n: int, r: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocked or not, each entry is the same left-to-right sum of rounded products: the bytes are
    those of the plain definition, whatever the block size."""
    p = torch.randn(r, m, generator=gen(40), dtype=torch.float64)
    q = torch.randn(r, n, generator=gen(41), dtype=torch.float64)
    reference = torch.zeros(m, n, dtype=torch.float64)
    for i in range(r):
        reference = reference + p[i].unsqueeze(1) * q[i].unsqueeze(0)
    for block_bytes in (8, 8 * n * 3, lowrank._BLOCK_BYTES):
        monkeypatch.setattr(lowrank, "_BLOCK_BYTES", block_bytes)
        assert torch.equal(lowrank._sum_of_outer_products(p, q), reference)


@pytest.mark.parametrize("m, n", [(40, 90), (90, 40), (64, 64)])
def test_thin_svd_matches_lapack_on_what_int4_keeps(m: int, n: int) -> None:
    a = low_rank_plus_noise(m, n, 6, 0.01, seed=42).double()
    u, sigma, vh = lowrank.thin_svd(a)
    reference = torch.linalg.svdvals(a)
    assert torch.allclose(sigma, reference, rtol=1e-9, atol=1e-12 * float(reference[0]))
    for r in (1, 6):  # the rank-r truncation is LAPACK's, to far below an int4 step
        truncated = (u[:, :r] * sigma[:r]) @ vh[:r]
        lu, ls, lvh = torch.linalg.svd(a, full_matrices=False)
        assert torch.allclose(truncated, (lu[:, :r] * ls[:r]) @ lvh[:r], atol=1e-9 * float(reference[0]))
    zero_u, zero_sigma, zero_vh = lowrank.thin_svd(torch.zeros(m, n, dtype=torch.float64))
    assert not zero_sigma.any() and not zero_u.isnan().any() and not zero_vh.isnan().any()


def test_singular_vector_signs_are_fixed() -> None:
    a = low_rank_plus_noise(40, 30, 3, 0.01, seed=19)
    p_pos, _ = compress({"w": a}, None, AdaptiveRankPolicy.fixed(3))
    p_neg, _ = compress({"w": -a}, None, AdaptiveRankPolicy.fixed(3))
    pos, neg = st_load(p_pos), st_load(p_neg)
    # P's pivot entries are positive either way; negating A flips Q instead
    p = quant.dequantize_groups(unpack_int4(pos["w.P.q"], 120), pos["w.P.scale"], 64).view(3, 40)
    p_of_neg = quant.dequantize_groups(unpack_int4(neg["w.P.q"], 120), neg["w.P.scale"], 64).view(3, 40)
    assert torch.equal(p, p_of_neg)
    assert all(float(row[row.abs().argmax()]) > 0 for row in p)


# ----------------------------------------------------------------------- validation of arrivals


M, N, R = 48, 40, 4


@pytest.fixture
def valid() -> tuple[bytes, dict, dict]:
    tensors = {"b": torch.randn(N, generator=gen(20)), "w": torch.randn(M, N, generator=gen(21))}
    payload, header = compress(tensors, None, AdaptiveRankPolicy.fixed(R))
    return payload, header, layout_of(tensors)


def forbid_reconstruction(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, fail the test if anything is reconstructed: validation must refuse first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a tensor was decompressed before the update was validated")

    monkeypatch.setattr(frame, "_reconstruct", forbidden)


@pytest.fixture
def no_reconstruction(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_reconstruction(monkeypatch)


def entry(header: dict, name: str) -> dict:
    return next(e for e in header["tensors"] if e["name"] == name)


def resave(payload: bytes, **changes: torch.Tensor) -> bytes:
    tensors = st_load(payload)
    tensors.update(changes)
    return st_save(tensors)


def test_valid_payload_decompresses(valid) -> None:
    payload, header, layout = valid
    out = decompress(payload, header, layout)
    assert set(out) == {"b", "w"} and out["w"].shape == (M, N)


HEADER_FAULTS = {
    "wrong factor shape": (lambda h: entry(h, "w")["parts"]["P"].update(shape=[M, R + 1]),
                           r"tensor w: field P\.shape: \[48, 5\], expected \[48, 4\]"),
    "rank too large": (lambda h: entry(h, "w").update(rank=N + 1),
                       r"tensor w: field rank: 41 outside \[1, min\(m, n\) = 40\]"),
    "rank zero": (lambda h: entry(h, "w").update(rank=0), r"tensor w: field rank"),
    "wrong scale count": (lambda h: entry(h, "w")["parts"]["Q"].update(num_scales=99),
                          r"tensor w: field Q\.num_scales: 99, expected 3"),
    "wrong packed length": (lambda h: entry(h, "w")["parts"]["P"].update(packed_len=97),
                            r"tensor w: field P\.packed_len: 97, expected 96"),
    "unknown name": (lambda h: entry(h, "w").update(name="w_evil"),
                     r"tensor w_evil: field name: unknown tensor"),
    "missing tensor": (lambda h: h["tensors"].remove(entry(h, "w")),
                       r"tensor w: field name: missing from the header"),
    "duplicate tensor": (lambda h: h["tensors"].append(copy.deepcopy(entry(h, "b"))),
                         r"tensor b: field name: appears twice"),
    "wrong dense shape": (lambda h: entry(h, "w").update(shape=[N, M]), r"tensor w: field shape"),
    "wrong dtype": (lambda h: entry(h, "b").update(dtype="float16"), r"tensor b: field dtype"),
    "unknown kind": (lambda h: entry(h, "w").update(kind="fp8"), r"tensor w: field kind"),
    "int8 for a matrix": (lambda h: entry(h, "w").update(kind="int8"), r"tensor w: field kind: int8"),
    "bad group size": (lambda h: entry(h, "b").update(group_size=0), r"tensor b: field group_size"),
    "boolean length": (lambda h: entry(h, "b")["parts"]["W"].update(num_scales=True),
                       r"tensor b: field W\.num_scales"),
    "wrong format": (lambda h: h.update(format="other/0"), r"header: format 'other/0'"),
}


@pytest.mark.parametrize("fault", sorted(HEADER_FAULTS))
def test_malformed_header_refused_by_name(valid, no_reconstruction, fault: str) -> None:
    payload, header, layout = valid
    mutate, message = HEADER_FAULTS[fault]
    mutate(header)
    with pytest.raises(CompressionError, match=message):
        decompress(payload, header, layout)


def nan_scale(payload: bytes) -> bytes:
    scale = st_load(payload)["w.P.scale"].clone()
    scale[1] = float("nan")
    return resave(payload, **{"w.P.scale": scale})


PAYLOAD_FAULTS = {
    "NaN scale": (nan_scale, r"tensor w: field P\.scale: 1 non-finite scale"),
    "negative scale": (lambda p: resave(p, **{"b.W.scale": -st_load(p)["b.W.scale"]}),
                       r"tensor b: field W\.scale: negative"),
    "short packed data": (lambda p: resave(p, **{"w.Q.q": st_load(p)["w.Q.q"][:-1].clone()}),
                          r"tensor w: field Q\.q: payload holds uint8\[79\], header implies uint8\[80\]"),
    "wrong q dtype": (lambda p: resave(p, **{"w.P.q": st_load(p)["w.P.q"].to(torch.int8)}),
                      r"tensor w: field P\.q: payload holds int8"),
    "missing entry": (lambda p: st_save({k: v for k, v in st_load(p).items() if k != "w.Q.scale"}),
                      r"tensor w: field Q\.scale: payload has no entry w\.Q\.scale"),
    "extra entry": (lambda p: resave(p, **{"x.W.q": torch.zeros(1, dtype=torch.uint8)}),
                    r"payload: unexpected entries \['x\.W\.q'\]"),
    "not safetensors": (lambda p: b"\x00" * 16, r"payload: payload is not a valid safetensors"),
}


@pytest.mark.parametrize("fault", sorted(PAYLOAD_FAULTS))
def test_malformed_payload_refused_by_name(valid, no_reconstruction, fault: str) -> None:
    payload, header, layout = valid
    mutate, message = PAYLOAD_FAULTS[fault]
    with pytest.raises(CompressionError, match=message):
        decompress(mutate(payload), header, layout)


def test_nonzero_padding_nibble_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.randn(7, 5, generator=gen(22))  # dense int4, 35 values: one padding nibble
    payload, header = compress({"w": a}, None, AdaptiveRankPolicy.fixed(3))
    assert header["tensors"][0]["kind"] == "int4"
    forbid_reconstruction(monkeypatch)
    packed = st_load(payload)["w.W.q"].clone()
    packed[-1] |= 0x30
    with pytest.raises(CompressionError, match=r"tensor w: field W\.q: padding nibble"):
        decompress(resave(payload, **{"w.W.q": packed}), header, layout_of({"w": a}))


# --------------------------------------------------------------------------- compression ratio


def test_ratio_256x1024_rank8_at_least_50x() -> None:
    a = low_rank_plus_noise(256, 1024, 8, 0.01, seed=23)
    payload, header = compress({"w": a}, None, AdaptiveRankPolicy.fixed(8))
    dense = 4 * a.numel()  # fp32
    data_ratio, wire_ratio = dense / compressed_size(header), dense / len(payload)
    a_hat = decompress(payload, header, layout_of({"w": a}))["w"]
    relative = float((a - a_hat).norm() / a.norm())
    print(f"256x1024 rank 8: {compressed_size(header)} data bytes ({data_ratio:.1f}x vs fp32), "
          f"{len(payload)} payload bytes ({wire_ratio:.1f}x); relative error {relative:.4f}")
    assert compressed_size(header) == (256 * 8 + 1024 * 8) // 2 + 4 * (256 * 8 + 1024 * 8) // 64
    assert wire_ratio >= 50 and data_ratio >= wire_ratio

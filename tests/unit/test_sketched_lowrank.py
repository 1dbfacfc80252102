"""The randomized decomposition of wide matrices (trainer.codec.lowrank, issue 30): which matrices
take it, how close its rank-r reconstruction is to the best one, that the rank policy picks what the
exact spectrum would, that the encode stays deterministic, and that the audit's re-compression of
an honest worker's update is at distance 0 while a scaled one is not."""

from __future__ import annotations

import pytest
import torch

from audit.replay import Replayer, recompressed
from trainer.codec import AdaptiveRankPolicy, CompressionConfig, compress, decompress
from trainer.codec import lowrank
from trainer.codec.policy import PinnedRankPolicy
from trainer.codec.wire import layout_of
from trainer.config import DILOCOX_COMPRESSION, RunConfig


def adamw_delta(m: int, n: int, steps: int = 3, seed: int = 0) -> torch.Tensor:
    """Δ = W₀ − W after a few AdamW steps of a linear layer (m × n) fitting random targets: the
    nearly flat spectrum of a real pseudo-gradient (AdamW's update is close to a sign)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n, m, bias=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    inputs, targets = torch.randn(512, n), torch.randn(512, m)
    start = layer.weight.detach().clone()
    for _ in range(steps):
        torch.nn.functional.mse_loss(layer(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return (start - layer.weight.detach()).double()


def decaying(m: int, n: int, decay: float, noise: float, seed: int) -> torch.Tensor:
    """σᵢ = exp(−i/decay) along random orthonormal directions, plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64)).Q
    sigma = torch.exp(-torch.arange(k, dtype=torch.float64) / decay)
    return (u * sigma) @ v.T + noise * torch.randn(m, n, generator=g, dtype=torch.float64) / n ** 0.5


def best(a: torch.Tensor, rank: int) -> torch.Tensor:
    u, sigma, vh = torch.linalg.svd(a, full_matrices=False)
    return (u[:, :rank] * sigma[:rank]) @ vh[:rank]


def test_which_matrices_are_sketched() -> None:
    # The ablation's GPT 2 × 128 (issue 31) at every max_rank it uses: exact, as before.
    for max_rank in (DILOCOX_COMPRESSION.max_rank, 24, CompressionConfig().max_rank):
        assert lowrank.sketch_size(128, 512, max_rank) is None
        assert lowrank.sketch_size(512, 128, max_rank) is None
    # The 100M cell's layers (k = 256 and 768) at r_max 32: sketched, s = 32 + 16.
    assert lowrank.sketch_size(768, 2048, 32) == lowrank.sketch_size(256, 768, 32) == 48
    assert lowrank.sketch_size(256, 768, 64) is None  # k = 256 ≤ 4 × 80


def test_a_128_by_512_matrix_at_max_rank_32_takes_the_exact_path(monkeypatch: pytest.MonkeyPatch) -> None:
    a = decaying(128, 512, 8.0, 0.1, seed=1).float()
    config = CompressionConfig(enabled=True, min_rank=16, max_rank=32, int4_group_size=128)
    before = compress({"w": a}, {}, AdaptiveRankPolicy(config))

    def no_sketch(*_: object) -> torch.Tensor:
        raise AssertionError("the randomized decomposition was used")

    monkeypatch.setattr(lowrank, "row_basis", no_sketch)
    assert compress({"w": a}, {}, AdaptiveRankPolicy(config)) == before
    with pytest.raises(AssertionError, match="randomized"):
        compress({"w": decaying(256, 512, 8.0, 0.1, seed=1).float()}, {}, AdaptiveRankPolicy(config))


@pytest.mark.parametrize("rank", [32, 64])
def test_sketched_reconstruction_is_close_to_the_best(rank: int) -> None:
    """‖A − Ã_r‖ within 3% of the optimum ‖A − A_r‖ on a real-like Δ (the README has the figures
    on the 100M cell's layers), far under what int4 adds to the factors (‖Â − Ã_r‖ / ‖Ã_r‖)."""
    a = adamw_delta(384, 1024)
    sketch = lowrank.sketch_size(384, 1024, rank)
    assert sketch is not None
    u, sigma, vh = lowrank.Decomposition.of(a, sketch).svd(rank)
    sketched = (u * sigma[:rank]) @ vh
    optimum = best(a, rank)
    excess = float((a - sketched).norm() / (a - optimum).norm()) - 1.0
    payload, header = compress({"w": a}, None, AdaptiveRankPolicy.fixed(rank))
    quantised = decompress(payload, header, layout_of({"w": a}))["w"]
    int4_error = float((quantised - sketched).norm() / sketched.norm())
    assert 0.0 <= excess < 0.03 and excess < int4_error / 4, (excess, int4_error)


def test_sketched_singular_values_estimate_the_top_ones_from_below() -> None:
    a = decaying(400, 900, 6.0, 0.02, seed=2)
    estimate = lowrank.spectrum(a, 48)
    exact = torch.linalg.svdvals(a)[:48]
    assert estimate.shape == (48,) and bool((estimate <= exact * (1 + 1e-9)).all())
    torch.testing.assert_close(estimate[:10], exact[:10], rtol=1e-5, atol=0.0)  # σ₁₀ ≈ 10 × the noise's


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_the_policy_picks_the_exact_spectrums_rank(seed: int) -> None:
    """Rounds of matrices whose energy reaches τ within r_max: the ranks chosen from the sketch's
    truncated spectrum (plus ‖Δ‖²) are the ranks chosen from the whole one."""
    config = CompressionConfig(enabled=True, target_energy=0.9, min_rank=2, max_rank=32, window=3)
    exact, sketched = AdaptiveRankPolicy(config), AdaptiveRankPolicy(config)
    chosen = []
    for r, decay in enumerate((3.0, 5.0, 8.0, 4.0)):
        a = decaying(300, 700, decay, 0.01, seed=seed * 10 + r)
        sketch = lowrank.sketch_size(300, 700, config.max_rank)
        assert sketch is not None
        want = exact.decide("w", lowrank.spectrum(a, None), (300, 700))
        got = sketched.decide("w", lowrank.spectrum(a, sketch), (300, 700), float(a.square().sum()))
        assert (got.rank, got.target_rank, got.kind) == (want.rank, want.target_rank, want.kind)
        assert got.energy == pytest.approx(want.energy, abs=1e-6)
        assert got.total_energy == pytest.approx(want.total_energy, rel=1e-12)
        chosen.append(got.rank)
    assert len(set(chosen)) > 1  # the rank moved: the agreement is not that of a clamp


def test_a_truncated_spectrum_is_validated_and_its_window_restored() -> None:
    config = CompressionConfig(target_energy=0.99, min_rank=2, max_rank=8, window=2)
    policy = AdaptiveRankPolicy(config)
    sigma = torch.tensor([3.0, 2.0, 1.0] + [0.5] * 9, dtype=torch.float64)
    with pytest.raises(ValueError, match="expected 8 to 100 singular values"):
        policy.decide("w", sigma[:5], (100, 300), 100.0)
    with pytest.raises(ValueError, match="total energy"):
        policy.decide("w", sigma, (100, 300), float("nan"))
    with pytest.raises(ValueError, match="expected 100 singular values"):
        policy.decide("w", sigma, (100, 300))
    decision = policy.decide("w", sigma, (100, 300), 100.0)
    # 16.25 of 100 within the sketch: τ is not reached there, so r* = d and the clamp gives r_max.
    assert (decision.target_rank, decision.rank) == (100, 8)
    assert decision.energy == pytest.approx(float((sigma[:8] ** 2).sum()) / 100.0)
    assert decision.total_energy == 100.0
    resumed = AdaptiveRankPolicy(config)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.decide("w", sigma, (100, 300), 100.0) == policy.decide("w", sigma, (100, 300), 100.0)
    # A whole spectrum (another length) restarts the tensor's window rather than mixing curves.
    whole = policy.decide("w", torch.ones(100, dtype=torch.float64), (100, 300))
    assert whole.window_energy == whole.energy


def test_the_sketched_encode_is_deterministic_and_its_feedback_consistent() -> None:
    config = CompressionConfig(enabled=True, min_rank=2, max_rank=8)
    tensors = [{"w": adamw_delta(200, 300, seed=s).float()} for s in (6, 7)]
    runs = []
    for _ in range(2):
        errors: dict[str, torch.Tensor] = {}
        policy = AdaptiveRankPolicy(config)
        runs.append([(compress(t, errors, policy), {k: e.clone() for k, e in errors.items()}) for t in tensors])
    assert runs[0][0][0][0] == runs[1][0][0][0] and runs[0][1][0][0] == runs[1][1][0][0]  # payload bytes
    assert all(torch.equal(x[1]["w"], y[1]["w"]) for x, y in zip(*runs))
    assert lowrank.sketch_size(200, 300, 8) == 24 and runs[0][1][0][1]["tensors"][0]["rank"] <= 8


def test_a_pinned_rank_beyond_the_sketch_uses_the_exact_decomposition() -> None:
    a = decaying(200, 400, 20.0, 0.05, seed=8)
    config = CompressionConfig(enabled=True, min_rank=1, max_rank=4)  # s = 20, sketched
    payload, header = compress({"w": a}, None, PinnedRankPolicy(config, {"w": 40}))
    assert header["tensors"][0]["rank"] == 40
    received = decompress(payload, header, layout_of({"w": a}))["w"]
    assert float((received - best(a, 40)).norm() / best(a, 40).norm()) < 0.2


def test_the_audits_recompression_of_a_sketched_update_is_exact() -> None:
    """audit.replay's ``recompressed`` (the real function) on an update whose matrices take the
    randomized path, over two rounds of error feedback: an honest update is at d = 0, and one
    scaled by 1.05 before compression is not."""
    compression = CompressionConfig(enabled=True, min_rank=2, max_rank=8)
    replayer = Replayer(None, RunConfig(compression=compression), {})  # type: ignore[arg-type]
    worker_errors: dict[str, torch.Tensor] = {}
    replay_errors: dict[str, torch.Tensor] = {}
    policy = AdaptiveRankPolicy(compression)
    for seed in (10, 11):
        delta = {"w": adamw_delta(160, 384, seed=seed).float(), "b": torch.randn(160)}
        assert lowrank.sketch_size(160, 384, compression.max_rank) is not None
        cheat_errors, carried = dict(worker_errors), dict(replay_errors)
        payload, header = compress(delta, worker_errors, policy)
        stored = decompress(payload, header, layout_of(delta))
        replay_errors, distance = recompressed(replayer.config, delta, replay_errors, stored)
        assert distance == 0.0
        assert all(torch.equal(replay_errors[k], worker_errors[k]) for k in delta)  # e' is the worker's e
        scaled = {k: 1.05 * t for k, t in delta.items()}
        pinned = PinnedRankPolicy(compression, {e["name"]: e["rank"] for e in header["tensors"]})
        cheat = decompress(*compress(scaled, cheat_errors, pinned), layout_of(delta))
        _, cheat_distance = recompressed(replayer.config, delta, carried, cheat)
        assert cheat_distance > 0.005, cheat_distance

"""The outer optimiser: SGD with Nesterov momentum on the averaged pseudo-gradient."""

import torch

from trainer.config import OuterConfig
from trainer.rounds.outer import outer_step, zero_momentum


def test_hand_computed_two_steps() -> None:
    # θ=1, Δ₁=0.5, η=0.7, μ=0.9:  m₁ = 0.5;  θ₁ = 1 - 0.7·(0.5 + 0.9·0.5) = 0.335
    # Δ₂=0.25:                    m₂ = 0.45 + 0.25 = 0.7;  θ₂ = 0.335 - 0.7·(0.25 + 0.63) = -0.281
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    theta = {"w": torch.tensor([1.0], dtype=torch.float64)}
    m = zero_momentum(theta)
    theta, m = outer_step(cfg, theta, m, {"w": torch.tensor([0.5], dtype=torch.float64)})
    assert torch.allclose(m["w"], torch.tensor([0.5], dtype=torch.float64))
    assert torch.allclose(theta["w"], torch.tensor([0.335], dtype=torch.float64))
    theta, m = outer_step(cfg, theta, m, {"w": torch.tensor([0.25], dtype=torch.float64)})
    assert torch.allclose(m["w"], torch.tensor([0.7], dtype=torch.float64))
    assert torch.allclose(theta["w"], torch.tensor([-0.281], dtype=torch.float64))


def test_plain_momentum_hand_computed() -> None:
    cfg = OuterConfig(lr=0.5, momentum=0.5, nesterov=False)
    theta, m = {"w": torch.tensor([2.0])}, {"w": torch.tensor([1.0])}
    # m = 0.5·1 + 1 = 1.5; θ = 2 - 0.5·1.5 = 1.25
    theta, m = outer_step(cfg, theta, m, {"w": torch.tensor([1.0])})
    assert theta["w"].item() == 1.25 and m["w"].item() == 1.5


def test_matches_torch_sgd_nesterov_up_to_fused_rounding() -> None:
    """torch's SGD fuses multiply-add on vectorised CPUs (one rounding where outer_step has two, so
    that every CPU agrees: trainer.rounds.transition); the two differ by float32 rounding only."""
    torch.manual_seed(0)
    cfg = OuterConfig()
    start = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    deltas = [{k: torch.randn_like(v) * 0.1 for k, v in start.items()} for _ in range(4)]

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    sgd = torch.optim.SGD(ref.values(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    theta, m = dict(start), zero_momentum(start)
    for delta in deltas:
        for k, p in ref.items():
            p.grad = delta[k].clone()
        sgd.step()
        theta, m = outer_step(cfg, theta, m, delta)
    for k in start:
        torch.testing.assert_close(theta[k], ref[k].detach(), rtol=1e-6, atol=1e-6)


def test_outer_step_leaves_inputs_untouched() -> None:
    cfg = OuterConfig()
    theta, delta = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.1)}
    m = {"w": torch.full((3,), 0.2)}
    snapshot = {n: t.clone() for n, t in (("theta", theta["w"]), ("m", m["w"]), ("delta", delta["w"]))}
    outer_step(cfg, theta, m, delta)
    assert torch.equal(theta["w"], snapshot["theta"])
    assert torch.equal(m["w"], snapshot["m"])
    assert torch.equal(delta["w"], snapshot["delta"])

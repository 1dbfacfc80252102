"""Where an overlapped worker starts its next round (trainer.worker.loops.OverlapStart): the delayed
rule takes back the worker's own transmitted Δ̂, the eager rule a proxy of the outer step still in flight."""

from __future__ import annotations

import pytest
import torch

from proto import Encoding
from tests.conftest import small_config
from trainer.codec.uplink import Slice
from trainer.config import ConfigError, OuterConfig, RoundConfig
from trainer.runtime.inner import InnerResult
from trainer.worker.loops import OverlapStart
from trainer.worker.role import RoundWork


def work(delta: dict[str, torch.Tensor], sent: dict[str, torch.Tensor] | None = None) -> RoundWork:
    """A round's work whose raw Δ is ``delta`` and whose transmitted Δ̂ is ``sent`` (else Δ)."""
    sent = delta if sent is None else sent
    return RoundWork(InnerResult(delta, 1.0, 1, 1), [Slice(0, 1, Encoding.DENSE_F32, b"", None, sent, None)])


def config(start: str, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, workers: int = 2):
    return small_config(outer=OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov),
                        rounds=RoundConfig(expected_workers=workers, quorum=workers, overlap=True,
                                           overlap_start=start))


def vec(*xs: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(xs, dtype=torch.float64)}


def test_delayed_takes_back_the_workers_own_transmitted_pseudo_gradient() -> None:
    """Δ̂ (what the store holds), not the raw Δ (which no one else has): the replay can rebuild it."""
    rule = OverlapStart(config("delayed"))
    start = rule.rebase(vec(1.0, 2.0), work(vec(9.0, 9.0), sent=vec(0.25, -0.5)))
    assert torch.equal(start["w"], torch.tensor([0.75, 2.5], dtype=torch.float64))


def test_eager_steps_by_the_last_displacement_plus_the_weighted_change_of_its_own_update() -> None:
    rule = OverlapStart(config("eager", lr=0.5, momentum=0.6, workers=4))
    c = 0.5 * 1.6 / 4
    assert rule.weight == pytest.approx(c)
    theta0, theta1 = vec(1.0, 1.0), vec(0.8, 1.1)
    d1, d2 = vec(0.4, -0.2), vec(0.1, 0.3)
    # first round: nothing in flight before it, U = 0 and Δ̂⁽⁰⁾ = 0; the transmitted Δ̂ is used
    s2 = rule.rebase(theta0, work(vec(7.0, 7.0), sent=d1))
    torch.testing.assert_close(s2["w"], theta0["w"] - c * d1["w"], rtol=0, atol=1e-15)
    s3 = rule.rebase(theta1, work(d2))
    expected = theta1["w"] - ((theta0["w"] - theta1["w"]) + c * (d2["w"] - d1["w"]))
    torch.testing.assert_close(s3["w"], expected, rtol=0, atol=1e-15)
    rule.reset()  # after a restart the history is gone
    torch.testing.assert_close(rule.rebase(theta1, work(d2))["w"], theta1["w"] - c * d2["w"], rtol=0, atol=1e-15)


def test_eager_lands_on_the_next_global_state_when_the_trajectory_is_steady() -> None:
    """Equal updates every round and a global state moving by the same U each round: the proxy is
    exact, so the eager start is θ⁽ʳ⁾ itself, where the delayed start is off by Δ − U."""
    step, delta = vec(0.03, -0.01), vec(0.5, 0.2)
    thetas = [{"w": torch.tensor([1.0, 2.0], dtype=torch.float64) - t * step["w"]} for t in range(6)]
    eager, delayed = OverlapStart(config("eager")), OverlapStart(config("delayed"))
    for r in range(1, 5):
        s_eager = eager.rebase(thetas[r - 1], work(delta))
        s_delayed = delayed.rebase(thetas[r - 1], work(delta))
        if r >= 2:
            torch.testing.assert_close(s_eager["w"], thetas[r]["w"], rtol=0, atol=1e-12)
            assert not torch.allclose(s_delayed["w"], thetas[r]["w"])


def test_plain_momentum_weighs_a_fresh_gradient_by_the_outer_lr_alone() -> None:
    assert OverlapStart(config("eager", lr=0.7, momentum=0.9, nesterov=False, workers=2)).weight == pytest.approx(0.35)


def test_an_unknown_overlap_start_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="rounds.overlap_start = 'soon' must be one of delayed, eager"):
        config("soon")

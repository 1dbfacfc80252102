"""Update checks and the mean: what may enter a round's average, and how it is summed."""

import math

import pytest
import torch

from tests.conftest import small_config
from tests.oracles import mean_pseudo_gradient
from trainer.codec.wire import encode_params, layout_of
from trainer.rounds.aggregation import (
    InvalidUpdate,
    check_finite,
    check_layout,
    check_norm,
    norm_bound,
    validate_payload,
)

EXPECTED = {"w": ("float32", (2, 3)), "b": ("float32", (3,))}


def good() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def test_layout_names_missing_and_unexpected_tensors() -> None:
    with pytest.raises(InvalidUpdate, match=r"missing tensors \['b'\], unexpected tensors \['c'\]"):
        check_layout({"w": ("float32", (2, 3)), "c": ("float32", (3,))}, EXPECTED)


def test_layout_names_wrong_shape_and_dtype() -> None:
    with pytest.raises(InvalidUpdate, match=r"tensor w: shape \[3, 2\], expected \[2, 3\]"):
        check_layout({**EXPECTED, "w": ("float32", (3, 2))}, EXPECTED)
    with pytest.raises(InvalidUpdate, match="tensor b: dtype float64, expected float32"):
        check_layout({**EXPECTED, "b": ("float64", (3,))}, EXPECTED)


def test_payload_must_match_its_header() -> None:
    lying = encode_params({"w": torch.zeros(3, 2), "b": torch.zeros(3)})
    with pytest.raises(InvalidUpdate, match="payload disagrees with its header at tensor w"):
        validate_payload(lying, EXPECTED, bound=1.0)


@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_values_are_named(value: float, kind: str) -> None:
    update = good()
    update["b"][1] = value
    with pytest.raises(InvalidUpdate, match=f"tensor b has 1 non-finite value.*{kind}"):
        check_finite(update)


def test_norm_bound() -> None:
    update = {"w": torch.full((4,), 0.5)}  # norm 1
    assert check_norm(update, 1.0) == pytest.approx(1.0)
    with pytest.raises(InvalidUpdate, match="exceeds the bound"):
        check_norm(update, 0.99)
    cfg = small_config()
    expected = 10 * cfg.inner.steps * cfg.inner.lr * (1 + cfg.inner.weight_decay) * math.sqrt(100)
    assert norm_bound(cfg, 100) == pytest.approx(expected)


def test_valid_payload_decodes() -> None:
    update = {"w": torch.full((2, 3), 0.01), "b": torch.zeros(3)}
    assert set(validate_payload(encode_params(update), layout_of(update), bound=1.0)) == {"w", "b"}


def test_an_all_zero_update_is_refused() -> None:
    with pytest.raises(InvalidUpdate, match="all zeros"):
        validate_payload(encode_params(good()), layout_of(good()), bound=1.0)
    update = good()
    update["b"][2] = 1e-30  # one non-zero value is enough
    validate_payload(encode_params(update), layout_of(update), bound=1.0)


def test_mean_does_not_depend_on_arrival_order() -> None:
    torch.manual_seed(1)
    updates = {f"w{i}": {"x": torch.randn(1000) * 10 ** (i - 2)} for i in range(5)}
    forward = mean_pseudo_gradient(updates)
    backward = mean_pseudo_gradient(dict(reversed(list(updates.items()))))
    assert torch.equal(forward["x"], backward["x"])
    assert torch.allclose(forward["x"], torch.stack([u["x"] for u in updates.values()]).mean(0), atol=1e-6)
    assert torch.equal(updates["w0"]["x"], updates["w0"]["x"].clone())  # inputs untouched


def test_mean_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no accepted updates"):
        mean_pseudo_gradient({})

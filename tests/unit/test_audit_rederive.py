"""audit.rederive: a round's checkpoint recomputed from stored bytes, exactly as the coordinator does."""

from __future__ import annotations

import hashlib

import pytest
import torch

from audit.rederive import RederiveError, genesis_outer_state, rederive
from tests.oracles import mean_pseudo_gradient
from trainer.codec.wire import encode_params
from trainer.config import OuterConfig
from trainer.rounds.outer import momentum_of, outer_state_of, outer_step, zero_momentum


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 4, generator=g) * scale, "b.bias": torch.randn(5, generator=g) * scale}


def test_matches_the_coordinators_arithmetic() -> None:
    cfg = OuterConfig()
    params, momentum = tensors(0), tensors(1, 0.1)
    updates = {"w1": tensors(2, 1e-3), "w0": tensors(3, 1e-3), "w2": tensors(4, 1e-3)}
    want_params, want_momentum = outer_step(cfg, params, momentum, mean_pseudo_gradient(updates))

    derived = rederive(cfg, encode_params(params), encode_params(outer_state_of(momentum)),
                       {w: encode_params(u) for w, u in updates.items()})
    assert derived.params == encode_params(want_params)
    assert derived.outer_state == encode_params(outer_state_of(want_momentum))
    assert derived.params_digest == hashlib.sha256(derived.params).digest()

    # The order updates are handed over in does not matter: they are summed in sorted worker order.
    reordered = {w: encode_params(updates[w]) for w in ("w2", "w0", "w1")}
    again = rederive(cfg, encode_params(params), encode_params(outer_state_of(momentum)), reordered)
    assert again == derived


def test_plain_momentum_differs_from_nesterov() -> None:
    params, momentum, update = tensors(0), tensors(1, 0.1), {"w0": encode_params(tensors(2, 1e-3))}
    start = (encode_params(params), encode_params(outer_state_of(momentum)), update)
    nesterov = rederive(OuterConfig(nesterov=True), *start)
    plain = rederive(OuterConfig(nesterov=False), *start)
    assert nesterov.params != plain.params and nesterov.outer_state == plain.outer_state


def test_refuses_updates_that_do_not_fit() -> None:
    params = tensors(0)
    state = encode_params(outer_state_of(zero_momentum(params)))
    wrong = {**tensors(1), "b.bias": torch.zeros(6)}
    with pytest.raises(RederiveError, match="update of w1 .*b.bias"):
        rederive(OuterConfig(), encode_params(params), state,
                 {"w0": encode_params(tensors(2)), "w1": encode_params(wrong)})
    with pytest.raises(RederiveError, match="update of w0: payload is not a valid safetensors"):
        rederive(OuterConfig(), encode_params(params), state, {"w0": b"not safetensors"})
    with pytest.raises(RederiveError, match="no participants"):
        rederive(OuterConfig(), encode_params(params), state, {})


def test_outer_state_names() -> None:
    with pytest.raises(ValueError, match="momentum.<param>"):
        momentum_of({"a.weight": torch.zeros(1)})
    with pytest.raises(RederiveError, match="momentum.<param>"):
        rederive(OuterConfig(), encode_params(tensors(0)), encode_params({"a.weight": torch.zeros(1)}),
                 {"w0": encode_params(tensors(1))})
    params = tensors(0)
    with pytest.raises(RederiveError, match="one momentum tensor per parameter"):
        rederive(OuterConfig(), encode_params(params), encode_params({"momentum.a.weight": torch.zeros(3, 4)}),
                 {"w0": encode_params(tensors(1))})


def test_genesis_outer_state_is_zero_momentum() -> None:
    params = tensors(0)
    assert genesis_outer_state(encode_params(params)) == encode_params(outer_state_of(zero_momentum(params)))

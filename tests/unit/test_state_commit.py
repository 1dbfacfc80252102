"""Stored inner states (trainer.runtime.state_commit): what a worker uploads round-trips to its
commitment, and bytes that are not a worker's state are refused by name."""

from __future__ import annotations

import hashlib

import pytest
import torch

from trainer.codec.wire import encode_params, layout_of
from trainer.config import InnerConfig, ModelConfig
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime.inner import InnerLoop, inner_state_bytes, inner_state_digest
from trainer.runtime.state_commit import (
    StateError,
    check_inner_state,
    decode_inner_state,
    split_inner_state,
    state_cid,
    state_due,
    state_limit,
)

MODEL = ModelConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)


def trained_state() -> tuple[dict, dict]:
    model = build_model(MODEL, 3)
    loop = InnerLoop(model, InnerConfig(steps=2, batch_size=2, lr=1e-3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(MODEL.vocab_size, (2, 8), generator=g), torch.randint(MODEL.vocab_size, (2, 8), generator=g))
               for _ in range(2)]
    loop.run(params_of(model), batches)
    errors = {f"error.{n}": torch.full_like(p, 1e-3) for n, p in params_of(model).items()}
    return loop.state(), errors


def test_the_uploaded_bytes_are_the_commitment_and_round_trip() -> None:
    adamw, errors = trained_state()
    layout = layout_of(params_of(build_model(MODEL, 3)))
    raw = inner_state_bytes(adamw, errors)
    assert hashlib.sha256(raw).hexdigest() == inner_state_digest(adamw, errors) == state_cid(
        inner_state_digest(adamw, errors)).hex
    assert len(raw) <= state_limit(layout)
    back_adamw, back_errors = split_inner_state(decode_inner_state(raw, layout, compressed=True))
    assert set(back_adamw) == set(adamw) and all(torch.equal(back_adamw[k], adamw[k]) for k in adamw)
    assert set(back_errors) == {k[len("error."):] for k in errors}
    check_inner_state({}, layout, compressed=False)  # a fresh state
    assert [state_due(3, r) for r in range(1, 7)] == [False, False, True, False, False, True]
    assert not state_due(0, 6)


def test_a_state_no_worker_could_hold_is_refused_by_name() -> None:
    adamw, errors = trained_state()
    layout = layout_of(params_of(build_model(MODEL, 3)))
    name = next(iter(layout))
    faults = [
        ({**adamw, **errors}, False, "no worker's state holds"),  # error feedback of a dense uplink
        ({k: v for k, v in adamw.items() if k != f"step.{name}"}, False, "not all of"),
        ({**adamw, f"exp_avg.{name}": adamw[f"exp_avg.{name}"].double()}, False, "expected float32"),
        ({**adamw, f"exp_avg.{name}": adamw[f"exp_avg.{name}"][:1]}, False, "expected float32 of shape"),
        ({**adamw, f"exp_avg_sq.{name}": adamw[f"exp_avg_sq.{name}"] * float("nan")}, False, "not finite"),
        ({**adamw, f"step.{name}": adamw[f"step.{name}"] + 1}, False, "one whole number"),
        ({**adamw, "pickle.evil": torch.zeros(1)}, False, "no worker's state holds"),
    ]
    for state, compressed, message in faults:
        with pytest.raises(StateError, match=message):
            decode_inner_state(encode_params(state), layout, compressed)
    with pytest.raises(StateError, match="inner state: "):
        decode_inner_state(b"\x00" * 64, layout, compressed=False)

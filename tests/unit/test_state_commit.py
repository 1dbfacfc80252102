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
    NO_STATE,
    Committed,
    StateBytes,
    StateError,
    StateUploads,
    check_inner_state,
    commitment,
    decode_inner_state,
    previous_in_window,
    split_inner_state,
    state_cid,
    state_due,
    state_limit,
    window_contributions,
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


def test_the_state_is_due_at_a_workers_first_counted_round_of_each_window() -> None:
    """due(r, p) = ⌊r/K⌋ > ⌊p/K⌋: present every round, a worker uploads on r % K == 0 as before; absent
    on such a round, at its next contribution; so a chain (from a stored or fresh state) is never
    longer than K, whoever was absent when."""
    assert [state_due(3, r, r - 1) for r in range(1, 7)] == [False, False, True, False, False, True]
    assert not state_due(0, 6, 5)
    assert not state_due(4, 3, 0)  # window 0: every worker's chain starts fresh in it
    assert state_due(4, 5, 3) and not state_due(4, 6, 5) and state_due(4, 9, 5)  # absent on rounds 4 and 8
    assert state_due(4, 6, 0)  # a first contribution in window 1 (its state is fresh: nothing is sent)
    for absent in [set(), {4}, {3, 4, 5}, {8}, {4, 5, 6, 7}, {1, 2, 3, 4, 5}]:
        present, previous, since_upload = [r for r in range(1, 13) if r not in absent], 0, 0
        for r in present:
            since_upload = 1 if state_due(4, r, previous) else since_upload + 1
            assert since_upload <= 4, (absent, r)
            previous = r
    participants = {2: "w at 2", 5: "w at 5", 6: "w at 6"}
    window = window_contributions(4, 7, participants.get)
    assert window == [(5, "w at 5"), (6, "w at 6")] and previous_in_window(window) == 6
    assert window_contributions(4, 4, participants.get) == [] and previous_in_window([]) == 0
    assert window_contributions(4, 3, participants.get) == [(2, "w at 2")]


def test_a_worker_sends_its_state_when_due_or_after_a_refused_push_never_a_fresh_one() -> None:
    """trainer.worker.role's side of the rule: p is its last push taken whole; a push never confirmed
    was refused, and since a lost reply reads the same, the next push carries the state, due or not,
    until one that carries it (or whose state is fresh) is taken."""
    uploads = StateUploads()
    assert uploads.take(4, 1, b"") == b"" and uploads.counted() is None  # fresh: nothing to send
    for r in (2, 3):
        assert uploads.take(4, r, b"state") == b""
        uploads.counted()
    assert uploads.take(4, 4, b"state") == b"state"  # its first of window [4, 8)
    uploads.counted()
    assert uploads.take(4, 5, b"state") == b""  # refused (never confirmed) ...
    assert uploads.take(4, 6, b"state") == b"state"  # ... so the next push carries it, and is refused too
    assert uploads.take(4, 7, b"state") == b"state"
    uploads.counted()
    assert uploads.take(4, 9, b"state") == b"state"  # absent from round 8: round 9 is its first of [8, 12)
    uploads.counted()
    assert uploads.take(4, 10, b"state") == b"" and uploads.last_counted == 9 and not uploads.in_doubt


def test_a_committed_state_makes_its_bytes_only_for_a_push_that_carries_them() -> None:
    """The worker keeps one copy of its start state and the digest (hashed as it is serialised); the
    bytes, the same as ``inner_state_bytes``, are made only when ``StateUploads`` sends them, and then
    a tensor at a time as they are sent (``StateBytes``), afresh for each attempt."""
    adamw, errors = trained_state()
    made: list[int] = []

    class Counted(Committed):
        def stream(self) -> StateBytes:
            made.append(1)
            return super().stream()

    committed = Counted(commitment(adamw, errors).digest, adamw, errors)
    whole = encode_params({**adamw, **errors})
    assert committed.digest == hashlib.sha256(inner_state_bytes(adamw, errors)).hexdigest()
    sent = committed.stream()
    assert sent.size == len(whole) and not committed.fresh
    assert b"".join(sent.chunks()) == whole and b"".join(sent.chunks()) == whole  # a retry makes them again
    assert max(len(c) for c in sent.chunks()) < len(whole)  # never the whole file at once
    made.clear()
    uploads = StateUploads()
    assert uploads.upload(4, 2, committed) is NO_STATE and not made  # not due: no bytes made
    uploads.counted()
    assert b"".join(uploads.upload(4, 4, committed).chunks()) == whole and made == [1]
    uploads.counted()
    fresh = commitment({}, {})
    assert fresh.fresh and fresh.stream() is NO_STATE and uploads.upload(4, 8, fresh) is NO_STATE
    assert uploads.upload(4, 9, None) is NO_STATE  # none committed reads as fresh
    assert NO_STATE.size == 0 and b"".join(NO_STATE.chunks()) == b""


def test_an_undone_round_restores_the_one_process_state_it_started_from() -> None:
    """``InnerLoop.snapshot`` is the state's copy by name (the commitment's); ``restore`` puts it back
    and the next step is the one the snapshot's state takes."""
    model = build_model(MODEL, 3)
    loop = InnerLoop(model, InnerConfig(steps=2, batch_size=2, lr=1e-3))
    x = torch.randint(MODEL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    start = params_of(model)
    loop.run(start, [(x, x)])
    snapshot = loop.snapshot()
    want = loop.run(start, [(x, x)]).pseudo_gradient
    loop.run(start, [(x, x), (x, x)])  # a round that does not count
    loop.restore(snapshot)
    got = loop.run(start, [(x, x)]).pseudo_gradient
    assert all(torch.equal(got[n], want[n]) for n in want)
    # restore copied the snapshot in: the steps after it did not write into the snapshot's tensors.
    assert inner_state_digest(loop.snapshot()) != inner_state_digest(snapshot)

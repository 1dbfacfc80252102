"""Where a round is aggregated: the one function that turns a closed round into the next checkpoint.

The coordinator calls ``round_transition`` when a round closes; the audit (``audit.rederive``) calls
it again on the stored bytes and compares digests. Nothing else computes a round. With θ⁽ʳ⁻¹⁾,
m⁽ʳ⁻¹⁾, e⁽ʳ⁻¹⁾ the parent's parameters, outer momentum and downlink error (``OuterState``), Δᵢ⁽ʳ⁾
the accepted updates as decoded from the bytes that were sent, and ρ̃ the previous K rounds' norms:

    Δ⁽ʳ⁾       = aggregate({Δᵢ⁽ʳ⁾}, rounds, ρ̃)               trainer.rounds.aggregation (clip, then mean,
                                                          trimmed mean or median)
    θ̃⁽ʳ⁾, m⁽ʳ⁾  = outer_step(outer, θ⁽ʳ⁻¹⁾, m⁽ʳ⁻¹⁾, Δ⁽ʳ⁾)      trainer.rounds.outer (Nesterov)

    dense downlink:        θ⁽ʳ⁾ = θ̃⁽ʳ⁾,  e⁽ʳ⁾ = ∅
    compressed downlink:   u⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾                 trainer.codec.downlink
                           C⁽ʳ⁾ = encode(u⁽ʳ⁾, e⁽ʳ⁻¹⁾)          the coordinator's choice (SVD, rank
                                                           policy); the audit passes the stored C⁽ʳ⁾
                           θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾)
                           e⁽ʳ⁾ = fl32(u⁽ʳ⁾ + e⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾))

How C⁽ʳ⁾ was chosen need not be reproducible (a LAPACK SVD is not, across machines); everything
else is, bit for bit, on any IEEE-754 CPU, because the arithmetic follows four rules:

  1. One rounding per operation. Every step is a single elementwise IEEE-754 operation (+, −, ×,
     ÷, a dtype conversion), correctly rounded to its result's dtype. No fused multiply-add: torch's
     vectorised CPU kernels fuse ``add(x, alpha=a)``, ``sub(alpha=)``, ``addcmul`` and ``lerp``
     into one rounding, its generic kernels (``ATEN_CPU_CAPABILITY=default``, other
     architectures) do not, so none of them is used here; a product is materialised, then added.
  2. Constants rounded once. μ, η and each clip scale sᵢ are rounded to the tensor's dtype
     (float32) before use; every multiply is then float32 × float32.
  3. A fixed reduction order. Updates are combined elementwise, in sorted worker-id order (the
     mean) or over values sorted per coordinate (trimmed mean, median); norms are sums of exactly
     squared float64 values added by ``math.fsum``, correctly rounded whatever the order. No
     reduction runs over a tensor's elements in torch, so the thread count changes nothing.
  4. Decompression is elementwise float64 (int × float32 scale is exact; the rank-1 terms of a
     low-rank factor product are added one by one in increasing i), then one rounding to float32.

``tests/unit/test_transition_exact.py`` pins the rules: the same stored run re-derives to the same
bytes under ``ATEN_CPU_CAPABILITY=default`` and the machine's best capability, with 1 thread and
several, and a float32 numpy re-implementation of a round matches bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch

from trainer.codec import CompressionError
from trainer.codec.downlink import DownlinkSession, EncodedDownlink, StoredDownlink, carried_error_tensor
from trainer.codec.wire import Layout, Params, ParamsPayload, decode_params, encode_params, layout_of
from trainer.config import OuterConfig, RoundConfig
from trainer.rounds.aggregation import Aggregation, norms_of, plan
from trainer.rounds.outer import downlink_error_of, momentum_of, outer_state_of, outer_step_tensor
from trainer.rounds.update_source import UpdateSource, source_of


class TransitionError(ValueError):
    """The inputs of a round cannot be combined (no updates, mismatched tensors, a bad downlink)."""


@dataclass(frozen=True)
class OuterState:
    """What a round starts from and produces: θ, m and the downlink error e (empty while the global
    update travels dense). Stored as two objects: the params, and the outer state
    (``momentum.<param>`` and ``downlink_error.<param>`` tensors, trainer.rounds.outer)."""

    params: Params
    momentum: Params
    downlink_error: Params = field(default_factory=dict)

    @classmethod
    def decode(cls, params: bytes, outer_state: bytes) -> OuterState:
        """From the stored bytes; raises TransitionError naming what does not fit."""
        try:
            theta = decode_params(params)
            state = decode_params(outer_state)
            momentum, error = momentum_of(state), downlink_error_of(state)
        except ValueError as exc:  # WireError is a ValueError
            raise TransitionError(str(exc)) from None
        if layout_of(momentum) != layout_of(theta):
            raise TransitionError("the outer state does not have one momentum tensor per parameter with the "
                                  "parameter's dtype and shape")
        return cls(theta, momentum, error)

    def params_bytes(self) -> bytes:
        return encode_params(self.params)

    def outer_state_bytes(self) -> bytes:
        return encode_params(outer_state_of(self.momentum, self.downlink_error))


class DownlinkEncoder(Protocol):
    """Chooses C⁽ʳ⁾ for the global update u⁽ʳ⁾ given the carried error e⁽ʳ⁻¹⁾ (not modified), one
    tensor at a time: ``open`` starts the round's session (trainer.codec.downlink.DownlinkSession)."""

    def open(self, layout: Layout) -> DownlinkSession: ...


def stored_downlink(payload: bytes, header: Mapping[str, Any]) -> DownlinkEncoder:
    """The encoder an auditor uses: whatever u⁽ʳ⁾ is, C⁽ʳ⁾ is the stored one."""
    return StoredDownlink(payload, header)


@dataclass(frozen=True)
class Transition:
    state: OuterState  # θ⁽ʳ⁾, m⁽ʳ⁾, e⁽ʳ⁾
    downlink: EncodedDownlink | None  # C⁽ʳ⁾ when the global update travels compressed
    aggregated: Aggregation  # how Δ⁽ʳ⁾ was reached (norms, clip threshold, scales)


def round_transition(parent: OuterState, updates: Mapping[str, Params | UpdateSource], *, outer: OuterConfig,
                     rounds: RoundConfig, history: Sequence[float] = (), norms: Mapping[str, float] | None = None,
                     downlink: DownlinkEncoder | None = None, release_parent: bool = False,
                     params_into: ParamsPayload | None = None) -> Transition:
    """The child of ``parent`` after the round whose accepted updates are ``updates`` (keyed by worker
    id: dicts of dense tensors, or trainer.rounds.update_source sources); see the module docstring.
    ``rounds`` fixes the aggregation rule, ``history`` is ρ̃ of the previous K rounds, ``norms`` the
    updates' exact norms when already known, ``downlink`` the encoder of C⁽ʳ⁾ when the global update
    travels compressed. Pure: the inputs are untouched, unless ``release_parent``: then the parent's
    m⁽ʳ⁻¹⁾ and e⁽ʳ⁻¹⁾ entries are taken out of its dicts as each tensor's successors are made, so the
    two outer states are never whole at once (the coordinator's close, whose parent outer state is
    not used again: a close that fails stops the coordinator, which resumes from the store). θ⁽ʳ⁻¹⁾
    is left in place either way. ``params_into``: θ⁽ʳ⁾ is written into it as each tensor is made, and
    the child's params are views of its bytes (the coordinator serves those bytes: θ⁽ʳ⁾ held once).

    One tensor at a time, in sorted name order: Δ⁽ʳ⁾ of the tensor (each update's tensor decoded,
    clipped, combined), the outer step, and with a compressed downlink u, û and e of the tensor; so
    besides θ, m, e and their successors only a few tensors' temporaries exist at once. Every
    operation is elementwise, so this gives the bits the same equations give on whole dicts."""
    if not updates:
        raise TransitionError("the round has no participants, so nothing to average")
    layout = layout_of(parent.params)
    sources = {worker: source_of(updates[worker]) for worker in sorted(updates)}
    for worker, source in sources.items():
        got = source.layout()
        if got != layout:
            names = sorted(n for n in set(got) | set(layout) if got.get(n) != layout.get(n))
            raise TransitionError(f"update of {worker} does not match the parameters at tensor {names[0]}: "
                                  f"{got.get(names[0], 'absent')} vs {layout.get(names[0], 'absent')}")
    if downlink is None and parent.downlink_error:
        raise TransitionError("the parent carries a downlink error, but the round's global update "
                              "is not compressed")
    how = plan(norms_of(sources, norms), rounds, history)
    with torch.no_grad():
        session = None
        if downlink is not None:
            try:
                session = downlink.open(layout)
            except CompressionError as exc:
                raise TransitionError(f"compressed global update: {exc}") from None
        try:
            child = _step_tensors(parent, sources, how, outer, session, release_parent, params_into)
            sent = session.finish() if session is not None else None
        except CompressionError as exc:
            if session is not None:
                session.abort()
            raise TransitionError(f"compressed global update: {exc}") from None
        except BaseException:
            if session is not None:
                session.abort()
            raise
    return Transition(child, sent, how)


def _step_tensors(parent: OuterState, sources: Mapping[str, UpdateSource], how: Aggregation, outer: OuterConfig,
                  session: DownlinkSession | None, release_parent: bool = False,
                  params_into: ParamsPayload | None = None) -> OuterState:
    """θ⁽ʳ⁾, m⁽ʳ⁾, e⁽ʳ⁾ tensor by tensor (``round_transition``; ``release_parent``: m⁽ʳ⁻¹⁾ and e⁽ʳ⁻¹⁾
    popped from the parent's dicts as they are used; θ⁽ʳ⁾ put into ``params_into``)."""
    def keep(name: str, theta: torch.Tensor) -> None:
        params[name] = params_into.put(name, theta) if params_into is not None else theta

    params: Params = {}
    momentum: Params = {}
    error: Params = {}
    for name in sorted(parent.params):
        delta = how.tensor(name, sources)
        theta = parent.params[name]
        previous = parent.momentum.pop(name) if release_parent else parent.momentum[name]
        target, momentum[name] = outer_step_tensor(outer, name, theta, previous, delta)
        del delta, previous
        if session is None:
            keep(name, target)
            continue
        update = torch.sub(theta, target)  # u⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾
        del target
        carried = parent.downlink_error.pop(name, None) if release_parent else parent.downlink_error.get(name)
        received = session.received(name, update, carried)
        error[name] = carried_error_tensor(update, carried, received)
        keep(name, torch.sub(theta, received))  # θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − û⁽ʳ⁾
    return OuterState(params, momentum, error)

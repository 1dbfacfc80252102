"""The compressed downlink: the coordinator's global update, sent as low-rank + int4 bytes that
every replica turns into the same parameters, bit for bit.

DiLoCoX (arXiv:2506.21263) compresses what crosses the network in both directions. The uplink is
each worker's pseudo-gradient (``trainer.codec`` with the worker's own error feedback); this
module is the way back. With θ⁽ʳ⁻¹⁾ the published parameters of round r−1 (what every worker
holds), θ̃⁽ʳ⁾ the outer optimiser's result (``trainer.rounds.outer.outer_step``) and e⁽ʳ⁻¹⁾ the
coordinator's downlink error buffer (e⁽⁰⁾ = 0):

    u⁽ʳ⁾   = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾                           the global update, float32
    A⁽ʳ⁾   = u⁽ʳ⁾ + e⁽ʳ⁻¹⁾                            float64, as trainer.codec forms it
    C⁽ʳ⁾   = compress(A⁽ʳ⁾)                          the bytes sent (adaptive rank, int4 factors)
    û⁽ʳ⁾   = decompress(C⁽ʳ⁾)                        float32, bit-identical on every machine
    θ⁽ʳ⁾   = θ⁽ʳ⁻¹⁾ − û⁽ʳ⁾                            the published checkpoint
    e⁽ʳ⁾   = fl32(A⁽ʳ⁾ − û⁽ʳ⁾)                        carried into the next round

The outer momentum m⁽ʳ⁾ is the optimiser's own (it depends on the averaged pseudo-gradient only).
e⁽ʳ⁾ is stored beside m⁽ʳ⁾ in the round's outer state (``downlink_error.<param>``), C⁽ʳ⁾ and its
codec header as objects the manifest names (``downlink``). An auditor holding θ⁽ʳ⁻¹⁾, e⁽ʳ⁻¹⁾ and
the round's updates therefore checks, with elementwise float operations only:

    θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾)   and   e⁽ʳ⁾ = fl32(u⁽ʳ⁾ + e⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾))

so nothing the compression dropped is lost: Σᵣ û⁽ʳ⁾ = Σᵣ u⁽ʳ⁾ + e⁽⁰⁾ − e⁽ᴿ⁾ up to float32 rounding.
How C⁽ʳ⁾ was chosen (the rank policy, the SVD) is the coordinator's business and need not be
reproducible; what each replica does with it is.

A worker that does not hold θ⁽ʳ⁻¹⁾ (it joined late, or fell behind) is sent θ⁽ʳ⁾ dense instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from trainer.codec import (
    AdaptiveRankPolicy,
    CompressedPayload,
    CompressionStream,
    RoundDecision,
    compress,
    decompress,
)
from trainer.codec.wire import Layout, Params


def global_update(previous: Params, target: Params) -> Params:
    """u⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾."""
    return {name: previous[name] - target[name] for name in previous}


def apply_update(previous: Params, received: Params) -> Params:
    """θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − û⁽ʳ⁾: what every replica computes from the bytes it received."""
    return {name: previous[name] - received[name] for name in previous}


def carried_error(update: Params, error: Mapping[str, torch.Tensor], received: Params) -> Params:
    """e⁽ʳ⁾ = fl32(u⁽ʳ⁾ + e⁽ʳ⁻¹⁾ − û⁽ʳ⁾), computed exactly as ``trainer.codec.compress`` does
    (float64 sum, one rounding); a missing e⁽ʳ⁻¹⁾ entry is zero."""
    return {name: carried_error_tensor(u, error.get(name), received[name]) for name, u in update.items()}


def carried_error_tensor(u: torch.Tensor, error: torch.Tensor | None, received: torch.Tensor) -> torch.Tensor:
    """``carried_error`` of one tensor (``error`` None: zero)."""
    return (carried_sum(u, error) - received.to(torch.float64)).to(torch.float32)


def carried_sum(u: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
    """A⁽ʳ⁾ = u⁽ʳ⁾ + e⁽ʳ⁻¹⁾ in float64, as ``trainer.codec.compress`` forms it."""
    a = u.to(torch.float64)
    return a + error.to(torch.float64) if error is not None else a


def decode_update(payload: bytes, header: Mapping[str, Any], layout: Layout,
                  device: torch.device | None = None) -> Params:
    """û⁽ʳ⁾ from the bytes: validated tensor by tensor against ``layout`` before any is rebuilt
    (raises ``trainer.codec.CompressionError`` naming the tensor and field); rebuilt on ``device``."""
    return decompress(payload, header, layout, device)


@dataclass(frozen=True)
class EncodedDownlink:
    """C⁽ʳ⁾: the compressed global update as sent, and its codec header."""

    payload: bytes
    header: Mapping[str, Any]


class DownlinkSession(Protocol):
    """One round's C⁽ʳ⁾, tensor by tensor (trainer.rounds.transition): ``received`` gives û⁽ʳ⁾ of each tensor
    in sorted name order, ``finish`` the bytes, ``abort`` undoes a round that fails half-way."""

    def received(self, name: str, update: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor: ...

    def finish(self) -> EncodedDownlink: ...

    def abort(self) -> None: ...


class DownlinkCompressor:
    """The coordinator's ``trainer.rounds.transition.DownlinkEncoder``: chooses C⁽ʳ⁾ with its rank policy,
    one tensor at a time (``open``). e⁽ʳ⁻¹⁾ belongs to the outer state, not to this object; the
    transition derives e⁽ʳ⁾."""

    def __init__(self, policy: AdaptiveRankPolicy) -> None:
        self.policy = policy

    def open(self, layout: Layout) -> DownlinkSession:
        return _CompressingSession(CompressionStream(self.policy))

    def __call__(self, update: Params, error: Params) -> EncodedDownlink:
        """C⁽ʳ⁾ of a whole u⁽ʳ⁾ (the same bytes as the tensor-by-tensor ``open``)."""
        # compress() would update a buffer in place; it gets a copy (e⁽ʳ⁾ is carried_error's).
        payload, header = compress(update, dict(error), self.policy)
        return EncodedDownlink(payload, header)

    @property
    def last_decision(self) -> RoundDecision:
        assert self.policy.last_decision is not None
        return self.policy.last_decision


class _CompressingSession:
    def __init__(self, stream: CompressionStream) -> None:
        self.stream = stream

    def received(self, name: str, update: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        return self.stream.add(name, update, carried_sum(update, error))

    def finish(self) -> EncodedDownlink:
        return EncodedDownlink(*self.stream.finish())

    def abort(self) -> None:
        self.stream.abort()


class StoredDownlink:
    """The encoder an auditor uses: whatever u⁽ʳ⁾ is, C⁽ʳ⁾ is the stored one, checked whole against
    the layout when the round opens it (``CompressionError`` names the tensor and field)."""

    def __init__(self, payload: bytes, header: Mapping[str, Any]) -> None:
        self.payload, self.header = payload, header

    def open(self, layout: Layout) -> DownlinkSession:
        return _StoredSession(self, CompressedPayload.parse(self.payload, self.header, layout))


class _StoredSession:
    def __init__(self, stored: StoredDownlink, parsed: CompressedPayload) -> None:
        self.stored, self.parsed = stored, parsed

    def received(self, name: str, update: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
        return self.parsed.tensor(name)

    def finish(self) -> EncodedDownlink:
        return EncodedDownlink(self.stored.payload, self.stored.header)

    def abort(self) -> None:
        pass

"""The compressed downlink: the coordinator's global update, sent as low-rank + int4 bytes that
every replica turns into the same parameters, bit for bit.

DiLoCoX (arXiv:2506.21263) compresses what crosses the network in both directions. The uplink is
each worker's pseudo-gradient (``trainer.compression`` with the worker's own error feedback); this
module is the way back. With θ⁽ʳ⁻¹⁾ the published parameters of round r−1 (what every worker
holds), θ̃⁽ʳ⁾ the outer optimiser's result (``trainer.diloco.outer_step``) and e⁽ʳ⁻¹⁾ the
coordinator's downlink error buffer (e⁽⁰⁾ = 0):

    u⁽ʳ⁾   = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾                           the global update, float32
    A⁽ʳ⁾   = u⁽ʳ⁾ + e⁽ʳ⁻¹⁾                            float64, as trainer.compression forms it
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
from typing import Any, Mapping

import torch

from trainer.compression import AdaptiveRankPolicy, RoundDecision, compress, decompress
from trainer.wire import Layout, Params


def global_update(previous: Params, target: Params) -> Params:
    """u⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾."""
    return {name: previous[name] - target[name] for name in previous}


def apply_update(previous: Params, received: Params) -> Params:
    """θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − û⁽ʳ⁾: what every replica computes from the bytes it received."""
    return {name: previous[name] - received[name] for name in previous}


def carried_error(update: Params, error: Mapping[str, torch.Tensor], received: Params) -> Params:
    """e⁽ʳ⁾ = fl32(u⁽ʳ⁾ + e⁽ʳ⁻¹⁾ − û⁽ʳ⁾), computed exactly as ``trainer.compression.compress`` does
    (float64 sum, one rounding); a missing e⁽ʳ⁻¹⁾ entry is zero."""
    out: Params = {}
    for name, u in update.items():
        a = u.to(torch.float64)
        if name in error:
            a = a + error[name].to(torch.float64)
        out[name] = (a - received[name].to(torch.float64)).to(torch.float32)
    return out


def decode_update(payload: bytes, header: Mapping[str, Any], layout: Layout) -> Params:
    """û⁽ʳ⁾ from the bytes: validated tensor by tensor against ``layout`` before any is rebuilt
    (raises ``trainer.compression.CompressionError`` naming the tensor and field)."""
    return decompress(payload, header, layout)


@dataclass(frozen=True)
class EncodedDownlink:
    """C⁽ʳ⁾: the compressed global update as sent, and its codec header."""

    payload: bytes
    header: Mapping[str, Any]


class DownlinkCompressor:
    """The coordinator's ``trainer.transition.DownlinkEncoder``: chooses C⁽ʳ⁾ with its rank policy.
    e⁽ʳ⁻¹⁾ belongs to the outer state, not to this object; the transition derives e⁽ʳ⁾."""

    def __init__(self, policy: AdaptiveRankPolicy) -> None:
        self.policy = policy

    def __call__(self, update: Params, error: Params) -> EncodedDownlink:
        # compress() would update a buffer in place; it gets a copy (e⁽ʳ⁾ is carried_error's).
        payload, header = compress(update, dict(error), self.policy)
        return EncodedDownlink(payload, header)

    @property
    def last_decision(self) -> RoundDecision:
        assert self.policy.last_decision is not None
        return self.policy.last_decision

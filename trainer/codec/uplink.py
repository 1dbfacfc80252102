"""What a worker sends up each round: its pseudo-gradient, one slice per pipeline stage, each slice
encoded by the stage that computed it.

DiLoCoX (Qi et al., arXiv:2506.21263) keeps a worker's parameters, inner optimiser state and
pseudo-gradient split by pipeline stage, and synchronises stage by stage. Here a worker of P
stages (trainer.runtime.pipeline; P = 1 for a one-process worker) cuts its pseudo-gradient Δᵢ⁽ʳ⁾ into the
slices Δᵢ,ₛ⁽ʳ⁾ named by ``stage_param_names(model, P)[s]``, and stage s encodes its own slice:

    dense        payload = safetensors(Δᵢ,ₛ)                       Δ̂ᵢ,ₛ = Δᵢ,ₛ
    compressed   Aᵢ,ₛ = Δᵢ,ₛ + eᵢ,ₛ
                 payload = C(Aᵢ,ₛ)                                  adaptive rank, int4 factors
                 Δ̂ᵢ,ₛ = decompress(payload),   eᵢ,ₛ ← Aᵢ,ₛ − Δ̂ᵢ,ₛ     (trainer.codec)

Each slice travels as its own PushUpdate stream with header (stage s, P). The coordinator checks
and decompresses every slice against stage s's layout as it arrives, and counts the worker when
all P slices are in: Δ̂ᵢ = ⋃ₛ Δ̂ᵢ,ₛ. The store keeps what crossed the wire: each slice's payload
bytes and codec header bytes (``codec_header_bytes``) as pushed, named by one update record

    {"schema": "dilocox.update/v1",
     "slices": [{"stage", "num_stages", "encoding": "dense_f32" | "lowrank_int4",
                 "payload": <RAW CID of the payload>, "header": <RAW CID of the codec header, or null>}]}

(canonical JSON, slices in stage order; trainer.runstore.update_record; ``dilocox.update/v2`` when each
slice also keeps the signature it was pushed with), whose CID the manifest names and whose digest
the worker's signed report restates; the audit re-derives Δ̂ᵢ from those bytes. A worker missing a
slice (a stage died, a push was refused) is out of the round.

The error-feedback state eᵢ,ₛ (with the rank policy's window) belongs to the worker process, not
to the stage process: it goes to the stage with each round's job and comes back updated, so a stage
that dies loses none of it. When any slice of a round is refused, the coordinator drops the
worker's other slices too, so every slice's Δ̂ᵢ,ₛ is carried back, eᵢ,ₛ ← eᵢ,ₛ + Δ̂ᵢ,ₛ, and goes out
with the next round: nothing the worker computed is lost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from proto import Encoding
from storage_client import canonical_json
from trainer.codec import (
    AdaptiveRankPolicy,
    CompressionConfig,
    ErrorFeedbackCompressor,
    RoundDecision,
)
from trainer.codec.wire import Params, encode_params


@dataclass(frozen=True)
class Slice:
    """One stage's encoded share of a worker's round."""

    stage: int
    num_stages: int
    encoding: str  # Encoding.DENSE_F32 or Encoding.LOWRANK_INT4
    payload: bytes
    codec_header: dict[str, Any] | None  # the compression header, for Encoding.LOWRANK_INT4
    transmitted: Params  # Δ̂ᵢ,ₛ: exactly what the coordinator rebuilds from ``payload``
    decision: RoundDecision | None  # the rank policy's choices, when compressed

    @property
    def codec_header_bytes(self) -> bytes | None:
        """The codec header as it travels (canonical JSON), None when dense: the push's
        ``compression_header`` and what the update record names."""
        return canonical_json(self.codec_header) if self.codec_header is not None else None


def encode_slice(delta: Params, stage: int, num_stages: int,
                 compressor: ErrorFeedbackCompressor | None) -> Slice:
    """Stage ``stage``'s slice of Δ, dense or compressed (``compressor``'s e is updated)."""
    if compressor is None:
        return Slice(stage, num_stages, Encoding.DENSE_F32, encode_params(delta), None, delta, None)
    transmitted: Params = {}  # Δ̂ᵢ,ₛ as the encoding rebuilt it: decompress(payload)'s bits, not decoded again
    payload, header, decision = compressor.compress(delta, received=transmitted)
    return Slice(stage, num_stages, Encoding.LOWRANK_INT4, payload, header, transmitted, decision)


def new_compressor(config: CompressionConfig, state: Params | None = None,
                   device: torch.device | None = None) -> ErrorFeedbackCompressor:
    """A stage's compressor, encoding on ``device`` (the worker's; the CPU by default)."""
    compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(config), device)
    if state is not None:
        compressor.load_state_dict(state)
    return compressor


def merged(slices: Sequence[Slice]) -> Params:
    """Δ̂ᵢ: every slice's transmitted tensors together (the slices partition the names)."""
    out: Params = {}
    for piece in slices:
        out.update(piece.transmitted)
    return out


def merged_decision(round_: int, slices: Sequence[Slice]) -> RoundDecision | None:
    decisions = [s.decision for s in slices if s.decision is not None]
    if not decisions:
        return None
    return RoundDecision(round_, {name: d for dec in decisions for name, d in dec.tensors.items()})


class Uplink:
    """A worker's error-feedback state, one compressor per stage (none when dense), thread-safe.

    ``states`` hands the stages their state for a round, ``update`` takes back what they return,
    ``carry_back`` (from the pushing thread, at any time) queues a refused round's Δ̂ to be folded
    into e before the next round's compression.
    """

    def __init__(self, config: CompressionConfig, num_stages: int, device: torch.device | None = None) -> None:
        self.config = config
        self.num_stages = num_stages
        self.compressors = ([new_compressor(config, device=device) for _ in range(num_stages)]
                            if config.enabled else None)
        self._carry: list[Params] = [{} for _ in range(num_stages)]
        self._lock = threading.Lock()

    @property
    def compressed(self) -> bool:
        return self.compressors is not None

    def _fold(self) -> None:
        """e ← e + everything carried back since the last round (called under the lock)."""
        assert self.compressors is not None
        for compressor, carry in zip(self.compressors, self._carry):
            if carry:
                compressor.carry_back(carry)
        self._carry = [{} for _ in range(self.num_stages)]

    def states(self) -> list[Params] | None:
        """Each stage's compressor state for the next round (None when dense)."""
        if self.compressors is None:
            return None
        with self._lock:
            self._fold()
            return [c.state_dict() for c in self.compressors]

    def update(self, states: Sequence[Params] | None) -> None:
        """The stages' compressor states after the round they compressed."""
        if self.compressors is None:
            return
        if states is None or len(states) != self.num_stages:
            raise ValueError(f"expected {self.num_stages} compressor states back from the stages")
        with self._lock:
            for compressor, state in zip(self.compressors, states):
                compressor.load_state_dict(state)

    def encode(self, delta: Params) -> Slice:
        """A one-process worker's round: its whole Δ, as stage 0 of 1."""
        if self.num_stages != 1:
            raise ValueError("Uplink.encode is for one-process workers; stages encode their own slices")
        if self.compressors is None:
            return encode_slice(delta, 0, 1, None)
        with self._lock:
            self._fold()
            return encode_slice(delta, 0, 1, self.compressors[0])

    def error_state(self) -> Params:
        """The worker's error-feedback buffers as the next round's compression will use them
        (``error.<param>``, every stage's together: the stages partition the names; empty when
        dense): part of the inner state a round commits to."""
        if self.compressors is None:
            return {}
        with self._lock:
            self._fold()
            return {f"error.{name}": e for name, e in sorted(
                (name, e) for compressor in self.compressors for name, e in compressor.errors.items())}

    def snapshot(self) -> list[Params] | None:
        """Every compressor's state (error buffer and rank policy) before a round, to ``restore`` if
        the round does not count (a one-process worker undoes it: trainer.runtime.inner.InnerLoop); the
        error buffers themselves, not copies (``ErrorFeedbackCompressor.state_dict``: never written
        into), so a worker holds e once."""
        if self.compressors is None:
            return None
        with self._lock:
            self._fold()
            return [c.state_dict(copy=False) for c in self.compressors]

    def restore(self, snapshot: list[Params] | None) -> None:
        with self._lock:
            self._carry = [{} for _ in range(self.num_stages)]
        self.update(snapshot)

    def carry_back(self, slices: Sequence[Slice]) -> None:
        """The coordinator holds none of these slices: their Δ̂ goes out again next round."""
        if self.compressors is None:
            return
        with self._lock:
            for piece in slices:
                carry = self._carry[piece.stage]
                for name, sent in piece.transmitted.items():
                    carry[name] = carry[name] + sent if name in carry else sent.clone()

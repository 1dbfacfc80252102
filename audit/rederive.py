"""Re-derive a round's checkpoint from stored bytes: the coordinator's own round transition
(``trainer.rounds.transition.round_transition``), run again by the auditor.

The transition's equations and the rules that make its bytes the same on every CPU are in its
module docstring; the auditor passes the stored compressed global update C⁽ʳ⁾ (the manifest's
downlink object) where the coordinator passed its compressor.

θ⁽ʳ⁻¹⁾ and m⁽ʳ⁻¹⁾ are decoded from round r-1's stored params and outer state (momentum tensors are
named ``momentum.<param>``). The results are encoded with ``trainer.codec.wire.encode_params`` (no
metadata, so equal tensors give equal bytes) and their sha256 must equal the digests the manifest
names. Each round starts from its parent's *stored* state, so one bad round does not make every
later round fail too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from trainer.codec.wire import Params, WireError, decode_params, encode_params
from trainer.config import OuterConfig, RoundConfig
from trainer.rounds.aggregation import PLAIN_MEAN, exact_norm
from trainer.rounds.outer import outer_state_of, zero_momentum
from trainer.rounds.transition import OuterState, TransitionError, round_transition, stored_downlink
from trainer.rounds.update_source import UpdateSource


class RederiveError(ValueError):
    """Stored bytes that cannot be combined as the round says (bad encoding, mismatched tensors)."""


@dataclass(frozen=True)
class RederivedCheckpoint:
    """A round's params and outer state as re-derived from stored bytes (``rederive``)."""

    params: bytes
    outer_state: bytes
    norms: dict[str, float] = field(default_factory=dict, compare=False)  # ‖Δᵢ‖ of each stored update

    @property
    def params_digest(self) -> bytes:
        return hashlib.sha256(self.params).digest()

    @property
    def outer_state_digest(self) -> bytes:
        return hashlib.sha256(self.outer_state).digest()


def _decode(what: str, data: bytes) -> Params:
    try:
        return decode_params(data)
    except WireError as exc:
        raise RederiveError(f"{what}: {exc}") from None


def genesis_outer_state(params_bytes: bytes) -> bytes:
    """The outer state a run must start from: zero momentum for every parameter (m⁽⁰⁾ = 0)."""
    params = _decode("genesis params", params_bytes)
    return encode_params(outer_state_of(zero_momentum(params)))


def _source(worker: str, update: bytes | UpdateSource) -> Params | UpdateSource:
    """An update as given: safetensors bytes of the dense Δ̂ᵢ (decoded), or an opened update
    record (trainer.runstore.update_record.open_update, decoded tensor by tensor as it is read)."""
    return _decode(f"update of {worker}", update) if isinstance(update, (bytes, bytearray)) else update


def update_norms(updates: Mapping[str, bytes | UpdateSource]) -> dict[str, float]:
    """‖Δᵢ‖₂ of stored updates, as the coordinator computed them (trainer.rounds.aggregation.exact_norm):
    what the next K rounds' clip threshold is taken over."""
    return {w: exact_norm(_source(w, data)) for w, data in sorted(updates.items())}


def rederive(outer: OuterConfig, parent_params: bytes, parent_outer_state: bytes,
             updates: Mapping[str, bytes | UpdateSource], downlink: tuple[bytes, Mapping[str, Any]] | None = None, *,
             rounds: RoundConfig = PLAIN_MEAN, history: Sequence[float] = ()) -> RederivedCheckpoint:
    """θ⁽ʳ⁾ and the outer state as bytes from round r-1's stored state, the round's stored updates
    (keyed by worker id, as in the manifest: opened update records, or dense safetensors bytes) and, when the global update travelled compressed, its
    stored bytes and codec header: ``trainer.rounds.transition.round_transition``, the coordinator's own
    function, with the stored C⁽ʳ⁾ as the downlink. ``rounds`` is the run's ``rounds`` section, whose
    clip_multiple, aggregator and trim_fraction fix the rule (default: no clip, the plain mean), and
    ``history`` ρ̃ of the previous ``rounds.clip_history_rounds`` rounds (trainer.runstore.round_inputs.ClipHistory)."""
    if not updates:
        raise RederiveError("the round has no participants, so nothing to average")
    try:
        parent = OuterState.decode(parent_params, parent_outer_state)
    except TransitionError as exc:
        raise RederiveError(f"parent state: {exc}") from None
    decoded = {worker: _source(worker, updates[worker]) for worker in sorted(updates)}
    encoder = stored_downlink(*downlink) if downlink is not None else None
    try:
        result = round_transition(parent, decoded, outer=outer, rounds=rounds, history=history, downlink=encoder)
    except TransitionError as exc:
        raise RederiveError(str(exc)) from None
    return RederivedCheckpoint(result.state.params_bytes(), result.state.outer_state_bytes(), result.aggregated.norms)

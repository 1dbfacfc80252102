"""Re-derive a round's checkpoint from stored bytes: the coordinator's arithmetic, done again.

    Δ⁽ʳ⁾      = trainer.aggregation.aggregate of the participants' stored updates under the run's
                ``rounds`` section: each clipped to c × the lower median of their norms and the
                previous K rounds' stored norms (c = 0: no clip), then the mean, trimmed mean or
                coordinate-wise median of the clipped updates (rounds.aggregator)
    θ̃⁽ʳ⁾, m⁽ʳ⁾ = outer_step(config.outer, θ⁽ʳ⁻¹⁾, m⁽ʳ⁻¹⁾, Δ⁽ʳ⁾)
    θ⁽ʳ⁾      = θ̃⁽ʳ⁾                                      when the global update travelled dense
    θ⁽ʳ⁾      = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾)                  when it travelled compressed (C⁽ʳ⁾ the
    e⁽ʳ⁾      = fl32(θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾ + e⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾))   manifest's downlink object; e the
                                                           downlink error in the outer state,
                                                           trainer.downlink)

θ⁽ʳ⁻¹⁾ and m⁽ʳ⁻¹⁾ are decoded from round r-1's stored params and outer state (momentum tensors are
named ``momentum.<param>``). The results are encoded with ``trainer.wire.encode_params`` (no
metadata, so equal tensors give equal bytes) and their sha256 must equal the digests the manifest
names. Each round starts from its parent's *stored* state, so one bad round does not make every
later round fail too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from trainer.aggregation import PLAIN_MEAN, aggregate, exact_norm, round_norm
from trainer.config import OuterConfig, RoundConfig
from trainer.compression import CompressionError
from trainer.diloco import downlink_error_of, momentum_of, outer_state_of, outer_step, zero_momentum
from trainer.downlink import apply_update, carried_error, decode_update, global_update
from trainer.wire import Params, WireError, decode_params, encode_params, layout_of

class RederiveError(ValueError):
    """Stored bytes that cannot be combined as the round says (bad encoding, mismatched tensors)."""


@dataclass(frozen=True)
class Derived:
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


def _outer_state(state: Params) -> tuple[Params, Params]:
    try:
        return momentum_of(state), downlink_error_of(state)
    except ValueError as exc:
        raise RederiveError(str(exc)) from None


def genesis_outer_state(params_bytes: bytes) -> bytes:
    """The outer state a run must start from: zero momentum for every parameter (m⁽⁰⁾ = 0)."""
    params = _decode("genesis params", params_bytes)
    return encode_params(outer_state_of(zero_momentum(params)))


def update_norms(updates: Mapping[str, bytes]) -> dict[str, float]:
    """‖Δᵢ‖₂ of stored updates, as the coordinator computed them (trainer.aggregation.exact_norm):
    what the next K rounds' clip threshold is taken over."""
    return {w: exact_norm(_decode(f"update of {w}", data)) for w, data in sorted(updates.items())}


def stored_round_norm(updates: Mapping[str, bytes]) -> float:
    """ρ̃ of a closed round from its stored updates (trainer.aggregation.round_norm of their
    ``exact_norm``s): what the round adds to the clip history of the next K rounds."""
    return round_norm(list(update_norms(updates).values()))


def clip_history(round_norms: Mapping[int, Sequence[float] | None], round_: int, k: int) -> list[float] | None:
    """The ``history`` round r's ``aggregate`` takes: the ρ̃ of rounds max(1, r−K)..r−1, from
    ``round_norms`` (round → [ρ̃], as ``stored_round_norm`` gives); None when one is unknown."""
    out: list[float] = []
    for earlier in range(max(1, round_ - k), round_):
        norms = round_norms.get(earlier)
        if norms is None:
            return None
        out.extend(norms)
    return out


def rederive(outer: OuterConfig, parent_params: bytes, parent_outer_state: bytes,
             updates: Mapping[str, bytes], downlink: tuple[bytes, Mapping[str, Any]] | None = None, *,
             rounds: RoundConfig = PLAIN_MEAN, history: Sequence[float] = ()) -> Derived:
    """θ⁽ʳ⁾ and the outer state as bytes from round r-1's stored state, the round's stored updates
    (keyed by worker id, as in the manifest) and, when the global update travelled compressed, its
    stored bytes and codec header. ``rounds`` is the run's ``rounds`` section, whose clip_multiple,
    aggregator and trim_fraction fix the rule (default: no clip, the plain mean), and ``history``
    the norms of the stored updates of the previous ``rounds.clip_history_rounds`` rounds
    (``update_norms``)."""
    if not updates:
        raise RederiveError("the round has no participants, so nothing to average")
    params = _decode("parent params", parent_params)
    momentum, error = _outer_state(_decode("parent outer state", parent_outer_state))
    layout = layout_of(params)
    if layout_of(momentum) != layout:
        raise RederiveError("parent outer state does not have one momentum tensor per parameter "
                            "with the parameter's dtype and shape")
    decoded: dict[str, Params] = {}
    for worker in sorted(updates):
        update = _decode(f"update of {worker}", updates[worker])
        got = layout_of(update)
        if got != layout:
            names = sorted(n for n in set(got) | set(layout) if got.get(n) != layout.get(n))
            raise RederiveError(f"update of {worker} does not match the parameters at tensor {names[0]}: "
                                f"{got.get(names[0], 'absent')} vs {layout.get(names[0], 'absent')}")
        decoded[worker] = update
    with torch.no_grad():
        aggregated = aggregate(decoded, rounds, history)
        delta, norms = aggregated.delta, aggregated.norms
        new_params, new_momentum = outer_step(outer, params, momentum, delta)
        if downlink is None:
            if error:
                raise RederiveError("the parent outer state carries a downlink error, but the round's global "
                                    "update is not compressed")
            return Derived(encode_params(new_params), encode_params(outer_state_of(new_momentum)), norms)
        try:
            received = decode_update(downlink[0], downlink[1], layout)
        except CompressionError as exc:
            raise RederiveError(f"compressed global update: {exc}") from None
        update = global_update(params, new_params)
        new_error = carried_error(update, error, received)
        published = apply_update(params, received)
    return Derived(encode_params(published), encode_params(outer_state_of(new_momentum, new_error)), norms)

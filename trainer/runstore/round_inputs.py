"""Round q's inputs read back from the store: what the round transition took when the coordinator
ran it.

trainer.rounds.transition.round_transition turns round q−1's state and round q's accepted updates into
round q's state. Running it again needs, from the store and the round's manifest alone:

    θ⁽q⁻¹⁾, m⁽q⁻¹⁾, e⁽q⁻¹⁾   the parent's checkpoint (``stored_state``; None for a round that keeps
                             none, which trainer.runstore.checkpoints rebuilds from an earlier one)
    {Δ̂ᵢ⁽q⁾}                  the participants' update records, decoded exactly as on arrival
                             (``round_updates``: trainer.runstore.update_record.open_update)
    ρ̃                        the clip history (``ClipHistory``): ρ̃⁽ᵉ⁾ for e = max(1, q−K)..q−1,
                             K = ``rounds.clip_history_rounds``, each round's
                             trainer.rounds.aggregation.round_norm of its updates' exact norms; empty when
                             the clip is off (``rounds.clip_multiple`` = 0: the rule takes none)
    C⁽q⁾                     the stored compressed global update, when the manifest names one
                             (``stored_global_update``)

``round_inputs`` reads the last three for one round. The coordinator's resume
(trainer.coordinator.machine: ρ̃ of the rounds closed before a restart), checkpoint rebuilding
(trainer.runstore.checkpoints) and the audit (audit.recompute: it reads each object through its findings, so
as to name every missing one, and keeps ρ̃ in a ``ClipHistory``) take them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from storage_client import Manifest, Store
from trainer.codec.wire import Layout, json_object
from trainer.config import ModelConfig, RoundConfig
from trainer.rounds.aggregation import round_norm, updates_round_norm
from trainer.rounds.transition import DownlinkEncoder, OuterState, TransitionError, stored_downlink
from trainer.rounds.update_source import UpdateSource
from trainer.runstore.update_record import open_update

# A closed round's accepted updates, by worker, for a round number (ClipHistory reads them lazily).
UpdatesOf = Callable[[int], Mapping[str, UpdateSource]]


def round_updates(store: Store, manifest: Manifest, layout: Layout, model: ModelConfig) -> dict[str, UpdateSource]:
    """Round's accepted updates by worker, opened from their records (trainer.runstore.update_record)."""
    return {p.worker: open_update(store, p.update, layout, model) for p in manifest.participants}


def stored_state(store: Store, manifest: Manifest) -> OuterState | None:
    """The round's θ, m and e from the store, or None when the store does not keep them. Raises
    StoreError or TransitionError when the stored bytes cannot be read."""
    if not (store.has(manifest.params) and store.has(manifest.outer_state)):
        return None
    return OuterState.decode(store.get(manifest.params), store.get(manifest.outer_state))


def stored_global_update(store: Store, manifest: Manifest) -> DownlinkEncoder | None:
    """C⁽q⁾ as stored (payload and codec header), or None when the round's global update went dense."""
    if manifest.downlink is None:
        return None
    header = json_object(store.get(manifest.downlink.header), "downlink codec header")
    return stored_downlink(store.get(manifest.downlink.payload), header)


class ClipHistory:
    """ρ̃ of closed rounds, and the clip history a round takes from them (module docstring).

    A round's ρ̃ is kept when the round is computed (``keep``, from its exact norms), or from its
    updates (``keep_updates``), or, with ``updates_of``, read back from the store the first time a
    later round needs it. Without ``updates_of`` a round never kept is unknown, and so is the
    history of the K rounds after it."""

    def __init__(self, rounds: RoundConfig, updates_of: UpdatesOf | None = None) -> None:
        self.k = rounds.clip_history_rounds
        self.clipping = rounds.clip_multiple > 0
        self.updates_of = updates_of
        self.norms: dict[int, float | None] = {}  # round -> ρ̃, None when unknown

    def keep(self, round_: int, norms: Mapping[str, float]) -> None:
        """Round ``round_``'s ρ̃ from its updates' exact norms (a transition's ``aggregated.norms``)."""
        self.norms[round_] = round_norm([norms[w] for w in sorted(norms)])

    def keep_updates(self, round_: int, updates: Mapping[str, UpdateSource] | None) -> None:
        """Round ``round_``'s ρ̃ from its updates (None: one of them is unavailable), when the clip needs it."""
        if self.clipping:
            self.norms[round_] = updates_round_norm(updates) if updates is not None else None

    def history(self, round_: int) -> list[float] | None:
        """ρ̃ of rounds max(1, r−K)..r−1 for round r = ``round_``, or None when one is unknown; ρ̃ of
        rounds before that window is forgotten (rounds are computed in order)."""
        out: list[float] = []
        earlier = range(max(1, round_ - self.k), round_) if self.clipping else range(0)
        for e in earlier:
            if e not in self.norms and self.updates_of is not None:
                self.norms[e] = updates_round_norm(self.updates_of(e))
            norm = self.norms.get(e)
            if norm is None:
                return None
            out.append(norm)
        for old in [e for e in self.norms if e < round_ - self.k]:
            del self.norms[old]
        return out


@dataclass(frozen=True)
class RoundInputs:
    """What round q's transition takes besides its parent's state."""

    updates: dict[str, UpdateSource]  # {Δ̂ᵢ⁽q⁾} by worker
    history: list[float]  # ρ̃ of the previous K rounds
    downlink: DownlinkEncoder | None  # the stored C⁽q⁾


def round_inputs(store: Store, manifest: Manifest, layout: Layout, model: ModelConfig,
                 clip: ClipHistory) -> RoundInputs:
    """Round ``manifest.round``'s updates, clip history and stored global update (module docstring).
    Raises StoreError, trainer.runstore.update_record.RecordError or TransitionError naming what cannot be read."""
    history = clip.history(manifest.round)
    if history is None:
        raise TransitionError(f"round {manifest.round}: the clip history is unknown (an earlier round's "
                              "updates are unavailable)")
    return RoundInputs(round_updates(store, manifest, layout, model), history, stored_global_update(store, manifest))


def manifest_updates(store: Store, manifest_of: Callable[[int], Manifest], layout: Layout,
                     model: ModelConfig) -> UpdatesOf:
    """``ClipHistory``'s reader of a closed round's updates from the store, ``manifest_of`` giving
    the round's manifest."""
    return lambda round_: round_updates(store, manifest_of(round_), layout, model)


"""Which rounds keep their full checkpoint, and how any other round's checkpoint is rebuilt.

Every round's manifest names the CIDs of its θ⁽ʳ⁾ and outer state (m⁽ʳ⁾, e⁽ʳ⁾), but the store keeps
their bytes only for genesis, every round r with r % K == 0 (K = ``rounds.checkpoint_every``) and
the run's last round. A round r in between is rebuilt from the newest stored checkpoint c ≤ r by
re-running the round transition (trainer.rounds.transition.round_transition) on each later round's
manifest, exactly as the coordinator ran it:

    for q = c+1 .. r:
        {Δ̂ᵢ⁽q⁾}, ρ̃, C⁽q⁾ = round q's inputs from the store (trainer.runstore.round_inputs: the decoded update
                           records, the clip history, the stored compressed global update)
        θ⁽q⁾, m⁽q⁾, e⁽q⁾ = round_transition(θ⁽q⁻¹⁾, m⁽q⁻¹⁾, e⁽q⁻¹⁾, {Δ̂ᵢ⁽q⁾}; ρ̃, C⁽q⁾)
        sha256 of their bytes must be the CIDs the manifest names (CheckpointError names q if not)

The transition's bits are the same on every CPU (its docstring's rules), so a rebuilt checkpoint
hashes to its manifest's CIDs. ``checkpoint_at`` is the one function that does this: the
coordinator's resume, the audit and ``dilocox export`` call it.
"""

from __future__ import annotations

from typing import Sequence

from storage_client import CID, Manifest, Store, StoreError
from trainer.codec.wire import layout_of
from trainer.config import RoundConfig, RunConfig
from trainer.progress import Progress
from trainer.rounds.transition import OuterState, TransitionError, round_transition
from trainer.runstore.round_inputs import ClipHistory, manifest_updates, round_inputs, stored_state
from trainer.runstore.update_record import RecordError

Lineage = Sequence[tuple[CID, Manifest]]  # storage_client.lineage: genesis first, index = round


class CheckpointError(ValueError):
    """A checkpoint cannot be rebuilt (a missing object, or a round that re-derives to other bytes)."""


def is_full_checkpoint(rounds: RoundConfig, round_: int) -> bool:
    """Whether round ``round_`` keeps its params and outer state in the store."""
    return round_ == 0 or round_ % rounds.checkpoint_every == 0 or round_ >= rounds.rounds


def _stored_state(store: Store, manifest: Manifest) -> OuterState | None:
    try:
        return stored_state(store, manifest)
    except (StoreError, TransitionError) as exc:
        raise CheckpointError(f"round {manifest.round}: the stored checkpoint cannot be read: {exc}") from None


def checkpoint_at(store: Store, chain: Lineage, round_: int, config: RunConfig | None = None,
                  progress: Progress | None = None) -> OuterState:
    """Round ``round_``'s θ, m and e: stored, or rebuilt from the newest stored checkpoint before it
    (module docstring). ``chain`` is the run's lineage up to at least ``round_``; ``config`` the run's
    (read from the genesis manifest when None); ``progress`` counts the stored checkpoint read and
    each round rebuilt. Raises CheckpointError naming the round that fails."""
    if not 0 <= round_ < len(chain):
        raise CheckpointError(f"round {round_} is not in the run's lineage (rounds 0..{len(chain) - 1})")
    if config is None:
        config = RunConfig.from_json(store.get_json(chain[0][1].config))
    base, state = round_, None
    while state is None:
        state = _stored_state(store, chain[base][1])
        if state is None:
            if base == 0:
                raise CheckpointError("the genesis checkpoint is not in the store")
            base -= 1
    if progress is not None:
        progress.add_total(round_ - base + 1)
        progress.advance()
    return rebuild_from(store, chain, base, state, round_, config, progress)


def rebuild_from(store: Store, chain: Lineage, base: int, state: OuterState, round_: int,
                 config: RunConfig, progress: Progress | None = None) -> OuterState:
    """``state`` (round ``base``'s) carried forward through rounds base+1..``round_`` (module
    docstring); ``progress`` counts the rounds rebuilt."""
    layout = layout_of(state.params)
    clip = ClipHistory(config.rounds, manifest_updates(store, lambda e: chain[e][1], layout, config.model))
    for q in range(base + 1, round_ + 1):
        manifest = chain[q][1]
        try:
            inputs = round_inputs(store, manifest, layout, config.model, clip)
            result = round_transition(state, inputs.updates, outer=config.outer, rounds=config.rounds,
                                      history=inputs.history, downlink=inputs.downlink)
        except (StoreError, RecordError, TransitionError, ValueError) as exc:
            raise CheckpointError(f"round {q}: cannot be rebuilt: {exc}") from None
        clip.keep(q, result.aggregated.norms)
        state = result.state
        if str(CID.of(state.params_bytes())) != manifest.params:
            raise CheckpointError(f"round {q}: the rebuilt params are not the manifest's {manifest.params}")
        if str(CID.of(state.outer_state_bytes())) != manifest.outer_state:
            raise CheckpointError(f"round {q}: the rebuilt outer state is not the manifest's {manifest.outer_state}")
        if progress is not None:
            progress.advance()
    return state

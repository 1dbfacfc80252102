"""Where a round is published: the round transition run on the closing round, then stored.

    Δ⁽ʳ⁾, (θ⁽ʳ⁾, m⁽ʳ⁾, e⁽ʳ⁾) = trainer.rounds.transition.round_transition(θ⁽ʳ⁻¹⁾, m⁽ʳ⁻¹⁾, e⁽ʳ⁻¹⁾, {Δ̂ᵢ})

the function the audit re-runs: each update clipped to c × the lower median of the round's norms
and the previous K rounds' ρ̃, averaged by the config's rule, the outer Nesterov step, and with
compression on, the global update compressed with error feedback (θ⁽ʳ⁾ is what the replicas rebuild
from those bytes). Then the downlink bytes, and θ⁽ʳ⁾ and m⁽ʳ⁾ when the round keeps a full
checkpoint (every ``rounds.checkpoint_every`` rounds and the last: trainer.runstore.checkpoints), go to the
store, then the round's manifest, then HEAD moves to it: a crash at any instant leaves either the old tip or the new.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from storage_client import CID, Manifest, canonical_json, to_e6
from storage_client.manifest import Downlink, Traffic
from trainer.coordinator.run import Run
from trainer.coordinator.state import CompressedGlobal, GlobalState, OpenRound
from trainer.codec.wire import ParamsPayload, cid_of_chunks, layout_of, params_chunks, streamable
from trainer.rounds.aggregation import Aggregation
from trainer.rounds.outer import outer_state_of
from trainer.rounds.transition import round_transition
from trainer.runstore.checkpoints import is_full_checkpoint
from trainer.runtime.memory import release_free_memory

log = logging.getLogger("dilocox.coordinator")


@dataclass(frozen=True)
class RoundOutcome:
    """A closing round's new global state, stored, before its manifest is written."""

    state: GlobalState  # manifest_cid still the parent's until the manifest is stored
    aggregated: Aggregation
    downlink: Downlink | None
    outer_state_cid: CID
    eval_loss: float
    # Seconds of the coordinator's work on the round, by phase ("aggregate": the round transition,
    # which includes compressing the global update; "store"; "evaluate"), for rounds.jsonl.
    phases: dict[str, float] = field(default_factory=dict)


def derive_round(run: Run, r: OpenRound, g: GlobalState, history: list[float]) -> RoundOutcome:
    """Aggregate the closing round's accepted updates onto ``g`` and store the result."""
    cfg, store = run.config, run.run_dir.store
    started = time.perf_counter()
    # θ⁽ʳ⁾ is written into the bytes that will be served as it is made, and held as views of them;
    # g's m and e are not used again (a close that fails stops the coordinator).
    layout = layout_of(g.params)
    into = ParamsPayload(layout) if streamable(layout) else None
    result = round_transition(g.outer, {w: a.source for w, a in r.accepted.items()}, outer=cfg.outer,
                              rounds=cfg.rounds, history=history,
                              norms={w: a.norm for w, a in r.accepted.items() if a.norm is not None},
                              downlink=run.downlink, release_parent=True, params_into=into)
    aggregated, child = result.aggregated, result.state
    aggregated_at = time.perf_counter()
    if aggregated.clipped:
        log.warning("round %d: clipped %s to norm %.4g (norms %s)", r.number, ", ".join(aggregated.clipped),
                    aggregated.threshold, ", ".join(f"{w} {n:.4g}" for w, n in sorted(aggregated.norms.items())))
    compressed, record = None, None
    if result.downlink is not None and run.downlink is not None:
        sent, header = result.downlink.payload, dict(result.downlink.header)
        compressed = CompressedGlobal(sent, canonical_json(header), str(g.params_cid))
        record = Downlink(payload=str(store.put(sent)), header=str(store.put_json(header)))
        decision = run.downlink.last_decision
        log.info("round %d: global update compressed to %d bytes (%s)", r.number, len(sent), decision.describe())
    release_free_memory()  # the transition's temporaries: before the checkpoint's bytes are made
    # The outer state (m and e, twice θ's size) is hashed, and stored, a tensor at a time: its bytes
    # are never whole in memory. θ's bytes are made whole: they are kept, to be served.
    # Both are stored only every K rounds (trainer.runstore.checkpoints); the manifest names them every round.
    full = is_full_checkpoint(cfg.rounds, r.number)
    outer_chunks = params_chunks(outer_state_of(child.momentum, child.downlink_error))
    outer_cid = store.put_chunks(outer_chunks) if full else cid_of_chunks(outer_chunks)
    payload = into.payload() if into is not None else child.params_bytes()
    params_cid = store.put(payload) if full else CID.of(payload)
    stored_at = time.perf_counter()
    eval_loss, eval_losses_e6 = run.evaluate(child.params)
    phases = {"aggregate": aggregated_at - started, "store": stored_at - aggregated_at,
              "evaluate": time.perf_counter() - stored_at}
    state = GlobalState(r.number, child.params, child.momentum, payload, params_cid, g.manifest_cid,
                        to_e6(eval_loss), compressed, child.downlink_error, eval_losses_e6)
    return RoundOutcome(state, aggregated, record, outer_cid, eval_loss, phases)


def record_round(run: Run, r: OpenRound, parent: GlobalState, derived: RoundOutcome, traffic: tuple[Traffic, ...],
                 dropped: tuple[str, ...]) -> tuple[CID, Manifest]:
    """Store the round's manifest and move HEAD to it: from here on the round is durable."""
    cfg, state = run.config, derived.state
    manifest = Manifest(
        run_id=cfg.run_id, round=r.number, parent=str(parent.manifest_cid), config=str(run.config_cid),
        params=str(state.params_cid), outer_state=str(derived.outer_state_cid),
        participants=tuple(a.entry.participant(w) for w, a in sorted(r.accepted.items())),
        dropped=dropped, eval_loss_e6=state.eval_loss_e6, bytes_up=sum(t.up for t in traffic),
        bytes_down=sum(t.down for t in traffic), downlink=derived.downlink, traffic=traffic,
    )
    manifest_cid = manifest.store(run.run_dir.store)
    run.run_dir.set_head(manifest_cid)
    run.run_dir.clear_pending(r.number)
    run.run_dir.clear_pending(r.number, "stages")
    return manifest_cid, manifest

"""Taking over a run another coordinator started: its run directory rebuilt from the chain and a mirror.

A run outlives its coordinator (docs/trust.md, "A run that outlives its coordinator"): once the
ledger names this account as the run's coordinator (``dilocox run hand-over`` by the run's creator,
or a vote of its workers), ``dilocox coordinator --take-over RUN_ID`` resumes the run in a run
directory whose store a mirror filled (``dilocox mirror``). Nothing of the first coordinator's
private files is needed (its TLS key, its chain key, its journals): the chain says how far the run
got, and the store holds what that is.

``take_over`` checks, in this order, and refuses with one line naming what is wrong:

  1. the ledger records the run, and names this account as its coordinator now;
  2. the mirror holds the manifest of the run's last recorded round R (else it is *behind*: the
     round and the CID are named, and ``dilocox mirror`` is to be run again);
  3. the mirror's lineage from that manifest back to genesis (storage_client.lineage: every parent
     link re-hashed) is the chain's: genesis manifest, and for each round r ≤ R the manifest and
     checkpoint digests the ledger recorded (else it *disagrees*: the round and both digests are
     named).

Then each worker's shard is taken from the manifests (workers.json: a worker keeps its shard, which
its reports restate), HEAD is set to round R's manifest and the settlement state says the run exists
on the ledger and is recorded through R, so the coordinator resumes at R (trainer.coordinator.run) and records
R+1 next under the same run id, its parent R's checkpoint. What was in flight at the first
coordinator (the updates and reports of round R+1, rounds it published past R but never recorded) is
not carried over: the workers push round R+1 again to the new coordinator (trainer.worker.succession).

A run directory that already took the run over resumes as any other (the state file says so); one
that holds another run's state is refused.
"""

from __future__ import annotations

from storage_client import CID, Codec, lineage
from trainer.runstore.run_dir import RunDir

from .ledger import Ledger

__all__ = ["SETTLEMENT_STATE", "TakeoverError", "take_over"]

SETTLEMENT_STATE = "settlement.json"  # settlement.report_book's state file


class TakeoverError(ValueError):
    """The run cannot be taken over from this run directory and chain; the message says why."""


def _hex(value: bytes) -> str:
    return "0x" + value.hex()


def take_over(run_dir: RunDir, ledger: Ledger, run_id: bytes) -> int:
    """Make ``run_dir`` resume ``run_id`` as this account's run (the module's checks); returns the
    last recorded round R it resumes at.

    @raise TakeoverError naming the run, round or CID that stands in the way
    """
    state = run_dir.load(SETTLEMENT_STATE, None)
    if state is not None:
        if isinstance(state, dict) and state.get("taken_over") == _hex(run_id):
            return int(state.get("taken_over_at", 0))  # taken over before: resumed as any run
        raise TakeoverError(f"{run_dir.path} already holds a run's settlement state ({SETTLEMENT_STATE}); "
                            f"take a run over into a directory filled by `dilocox mirror` only")
    run = ledger.run_of(run_id)
    if run is None:
        raise TakeoverError(f"the ledger {ledger.address} records no run {_hex(run_id)}")
    if run.coordinator != ledger.chain.address:
        raise TakeoverError(f"the ledger names {run.coordinator} as the coordinator of run {_hex(run_id)[:18]}…, "
                            f"not this account {ledger.chain.address}: the run's creator hands it over first "
                            f"(`dilocox run hand-over`), or its workers vote this account in")
    recorded = ledger.recorded_round_events(run_id)
    last = len(recorded)
    if [r.round for r in recorded] != list(range(1, last + 1)) or last != run.last_round:
        raise TakeoverError(f"the ledger's RoundRecorded events of run {_hex(run_id)[:18]}… are not rounds 1 to "
                            f"{run.last_round}: the ledger is not what it claims")
    tip = CID(Codec.JSON, recorded[-1].manifest_digest if recorded else run.genesis_manifest)
    if not run_dir.store.has(tip):
        raise TakeoverError(f"the mirror in {run_dir.path} is behind the chain: it does not hold round {last}'s "
                            f"manifest {tip}, the run's last recorded round; run `dilocox mirror` again")
    manifests = lineage(run_dir.store, tip)
    expected = [(run.genesis_manifest, run.genesis_checkpoint)] + [(r.manifest_digest, r.checkpoint) for r in recorded]
    if len(manifests) != len(expected):
        raise TakeoverError(f"the mirror's lineage from {tip} has {len(manifests)} manifests, but the chain "
                            f"records rounds 0 to {last}")
    for (cid, manifest), (manifest_digest, checkpoint) in zip(manifests, expected, strict=True):
        params = CID.parse(manifest.params).digest
        if cid.digest != manifest_digest or params != checkpoint:
            raise TakeoverError(f"the mirror disagrees with the chain at round {manifest.round}: manifest {cid} "
                                f"(checkpoint {_hex(params)}), the ledger recorded manifest {_hex(manifest_digest)} "
                                f"(checkpoint {_hex(checkpoint)})")
    head = run_dir.head()
    if head is not None and head != tip:
        raise TakeoverError(f"{run_dir.path} holds HEAD {head}, not round {last}'s manifest {tip} that the chain "
                            f"records; take the run over into a directory filled by `dilocox mirror` only")
    # Each worker keeps the shard the run's manifests say it trained on (its reports restate that
    # shard's digest), whichever coordinator it joins.
    run_dir.save_workers({p.worker: p.shard for _, manifest in manifests for p in manifest.participants})
    run_dir.set_head(tip)
    # Written last: a crash before it leaves a directory that takes the run over again from the start.
    run_dir.save(SETTLEMENT_STATE, {"run_created": True, "queued_through": last, "taken_over": _hex(run_id),
                                    "taken_over_at": last})
    return last

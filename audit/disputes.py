"""Verdicts with teeth: the audit's failed findings as EIP-712 verdicts, submitted; the run's disputes shown.

``verdicts_of`` turns the failures that name one round and one party into ``attestation.verdict.Verdict``s:

  worker       a replay MISMATCH of the worker's contribution to round r (audit.replay): the check
               ``replay``, the evidence the worker's update record (its report's updateDigest, the
               object the replay compared against)
  coordinator  a round-level failure only the coordinator can cause, in round r ≥ 1: ``ghost`` (a
               participant the ledger does not account for), ``push-signature`` (an update no admitted
               worker's push signed, which the coordinator alone checked and stored: a ghost it added
               as unreported), ``rederive`` (the round's params
               are not what its stored updates give), ``checkpoint`` (the chain's checkpoint is not
               the manifest's params), ``parent`` and ``manifest-round`` (the round's manifest does not
               chain): the evidence the round's manifest. A round with such a failure is voided whole,
               so its workers' verdicts are not sent.

``submit`` signs each with the auditor's attested key and sends it to the disputes contract; each
one's outcome is ``upheld`` or the contract's named refusal (``DisputesWindowClosed``,
``DisputesAlreadyVoided``, …). ``read_disputes`` is what every audit shows of a run: each upheld
verdict from the contract's ``VerdictUpheld`` events, with the party's worker id; ``unbacked_voids``
is what the audit checks of them (``tally``): the ledger voided exactly the credits upheld verdicts of
admitted auditors, inside their rounds' windows, void.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attestation.verdict import Verdict, check_id
from settlement import ChainError
from settlement.disputes import Disputes
from settlement.records import CreditVoided, RoundRecord, RunRecord
from settlement.roster import Roster
from storage_client import hex32

from .checks import AuditCheck
from .result import AuditResult

if TYPE_CHECKING:
    from attestation import Policy
    from settlement import Deployment
    from storage_client import Store

log = logging.getLogger("dilocox.audit")

# Failures of a round that the run's coordinator alone can cause: a verdict against it voids the round.
COORDINATOR_CHECKS = (AuditCheck.GHOST, AuditCheck.PUSH_SIGNATURE, AuditCheck.REDERIVE, AuditCheck.CHECKPOINT,
                      AuditCheck.PARENT, AuditCheck.MANIFEST_ROUND)
CHECK_NAMES = {check_id(str(check)): str(check) for check in AuditCheck}


@dataclass
class DisputeRow:
    """One dispute of the run: its verdict, the party's worker id (``coordinator`` for the run's), and
    its outcome — ``upheld`` or the contract's refusal — with the transaction and signers when upheld."""

    verdict: Verdict
    party_id: str
    outcome: str
    tx_hash: str | None = None
    signers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**self.verdict.to_json(), "party_id": self.party_id, "outcome": self.outcome,
                "tx_hash": self.tx_hash, "signers": list(self.signers)}


def verdicts_of(result: AuditResult, rounds: list[RoundRecord], coordinator: str) -> list[Verdict]:
    """The verdicts the audit's failures support, one per (round, party), coordinator's first."""
    if result.run_id is None:
        return []
    by_round = {record.round: record for record in rounds}
    verdicts: dict[tuple[int, str], Verdict] = {}
    for failure in result.failures:
        record = by_round.get(failure.round) if failure.round else None
        if record is not None and failure.check in COORDINATOR_CHECKS and (record.round, coordinator) not in verdicts:
            verdicts[(record.round, coordinator)] = Verdict(result.run_id, record.round, coordinator, str(failure.check),
                                                            record.manifest_digest)
    voided = {r for r, _ in verdicts}
    roster = result.roster or Roster()
    rows = result.replay.rows if result.replay is not None else []
    for row in rows:
        record = by_round.get(row.round)
        address = roster.address_of(row.worker)
        if row.status != "MISMATCH" or record is None or address is None or row.round in voided:
            continue
        update = next((s.report.update_digest for s in record.reports if s.report.worker == address), None)
        if update is not None and (row.round, address) not in verdicts:
            verdicts[(row.round, address)] = Verdict(result.run_id, row.round, address, str(AuditCheck.REPLAY), update)
    return sorted(verdicts.values(), key=lambda v: (v.round, v.party != coordinator, v.party))


def submit(disputes: Disputes, verdicts: list[Verdict], rounds: list[RoundRecord],
           sign: Callable[[Verdict], bytes], party_id: Callable[[str], str]) -> list[DisputeRow]:
    """Sign (``sign(verdict) -> signature``) and send each verdict; its outcome as the contract says."""
    by_round = {record.round: record for record in rounds}
    rows = []
    for verdict in verdicts:
        try:
            receipt = disputes.dispute(verdict, by_round[verdict.round], [sign(verdict)])
        except ChainError as exc:
            rows.append(DisputeRow(verdict, party_id(verdict.party), f"refused: {exc}"[:300]))
            continue
        rows.append(DisputeRow(verdict, party_id(verdict.party), "upheld",
                               "0x" + bytes(receipt["transactionHash"]).hex()))
    return rows


def read_disputes(disputes: Disputes, run_id: bytes, coordinator: str, roster: Roster | None) -> list[DisputeRow]:
    """Every upheld verdict of the run, oldest first, as the contract's events tell it."""
    label = _labeller(coordinator, roster)
    rows = []
    for event in disputes.verdicts(run_id):
        verdict = Verdict(event.run_id, event.round, event.party, CHECK_NAMES.get(event.check, hex32(event.check, "check")),
                          event.evidence)
        rows.append(DisputeRow(verdict, label(event.party), "upheld", event.tx_hash, event.signers))
    return rows


def _labeller(coordinator: str, roster: Roster | None) -> Callable[[str], str]:
    roster = roster or Roster()
    return lambda address: "coordinator" if address == coordinator else roster.id_of(address)


@dataclass(frozen=True)
class DisputeOptions:
    """How ``dilocox audit --dispute`` disputes: the chain key of the disputes contract's owner (it
    verifies the auditor's evidence and admits it, and sends the verdicts; anyone may send them), and
    the auditor's attestation provider (``dev`` with its root directory, or ``tdx``)."""

    owner_key: bytes
    provider: str
    dev_root_dir: str | None

    def __repr__(self) -> str:
        return f"DisputeOptions(provider={self.provider!r}, dev_root_dir={self.dev_root_dir!r}, owner_key=<hidden>)"


def dispute_findings(result: AuditResult, rpc_url: str, deployment: Deployment, store: Store, policy: Policy,
                     options: DisputeOptions) -> list[DisputeRow]:
    """Turn ``result``'s failures into verdicts, attest a fresh auditor key, have it admitted, and
    submit each verdict signed with it; returns each one's outcome (none when nothing is disputable).

    @raise settlement.ChainError when the chain cannot be used; attestation errors when the auditor
        cannot attest or its evidence is refused
    """
    from attestation import open_provider
    from settlement import Chain, Ledger
    from storage_client import CID, Codec

    from .auditor import Auditor, admit

    if result.run_id is None:
        return []
    chain = Chain(rpc_url, options.owner_key)
    ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
    run = ledger.run_of(result.run_id)
    address = ledger.disputes_address()
    if run is None or address is None:
        raise ChainError(f"the ledger {ledger.address} has no run 0x{result.run_id.hex()} or no disputes contract")
    disputes = Disputes(chain, address, from_block=deployment.deployed_block)
    rounds = ledger.recorded_rounds(result.run_id)
    verdicts = verdicts_of(result, rounds, run.coordinator)
    if not verdicts:
        log.info("dispute: no failure of this audit names one round and one party; no verdict submitted")
        return []
    config_cid = str(CID(Codec.JSON, run.config_digest))
    auditor = Auditor.attest(open_provider(options.provider, dev_root_dir=options.dev_root_dir), result.run_id,
                             config_cid)
    admit(disputes, store, auditor, config_cid, policy)
    return submit(disputes, verdicts, rounds, lambda verdict: auditor.sign(verdict, disputes),
                  _labeller(run.coordinator, result.roster))


def unbacked_voids(disputes: Disputes, voided: list[CreditVoided], rounds: list[RoundRecord], run: RunRecord,
                   run_id: bytes) -> list[tuple[int, str, str]]:
    """(round, worker, why) for each credit the ledger's voids and the disputes contract's verdicts
    disagree on: a ``CreditVoided`` that no upheld verdict backs (one against the worker or the run's
    coordinator in that round, every signer admitted to the run by then, inside the round's window),
    and a credit an upheld verdict voids that the ledger still counts. The audit trusts neither
    contract's word alone: a ledger that voids an honest worker's credit, or keeps a cheat's, is named."""
    admitted = {a.auditor: a.block for a in disputes.admissions(run_id)}
    recorded_at = {record.round: record.block for record in rounds}
    workers = {record.round: record.workers for record in rounds}
    backed: set[tuple[int, str]] = set()
    problems: list[tuple[int, str, str]] = []
    for verdict in disputes.verdicts(run_id):
        unadmitted = [s for s in verdict.signers if admitted.get(s, verdict.block + 1) > verdict.block]
        late = verdict.round not in recorded_at or verdict.block >= recorded_at[verdict.round] + run.challenge_window
        if unadmitted or late:
            why = (f"signed by {', '.join(unadmitted)}, not admitted to the run by block {verdict.block}" if unadmitted
                   else f"upheld in block {verdict.block}, outside the round's challenge window")
            problems.append((verdict.round, verdict.party, f"the verdict against it ({verdict.tx_hash}) was {why}"))
            continue
        parties = workers.get(verdict.round, ()) if verdict.party == run.coordinator else (verdict.party,)
        backed |= {(verdict.round, party) for party in parties}
    voids = {(v.round, v.worker) for v in voided}
    for round_, worker in sorted(voids - backed):
        problems.append((round_, worker, "the ledger voided its credit, but no upheld verdict backs that"))
    for round_, worker in sorted(backed - voids):
        problems.append((round_, worker, "an upheld verdict voids its credit, but the ledger still counts it"))
    return problems

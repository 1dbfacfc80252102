"""Verdicts with teeth: the audit's failed findings as EIP-712 verdicts, submitted; the run's disputes shown.

``verdicts_of`` turns the failures that name one round and one party into ``attestation.verdict.Verdict``s:

  worker       a replay MISMATCH of the worker's contribution to round r (audit.replay): the check
               ``replay``, the evidence the worker's update record (its report's updateDigest, the
               object the replay compared against); or a committed inner state it did not reveal when
               challenged (audit.reveal): the check ``reveal``, the same evidence
  coordinator  a round-level failure only the coordinator can cause, in round r ≥ 1: ``ghost`` (a
               participant the ledger does not account for), ``push-signature`` (an update no admitted
               worker's push signed, which the coordinator alone checked and stored: a ghost it added
               as unreported), ``rederive`` (the round's params
               are not what its stored updates give), ``checkpoint`` (the chain's checkpoint is not
               the manifest's params), ``parent`` and ``manifest-round`` (the round's manifest does not
               chain): the evidence the round's manifest. A round with such a failure is voided whole,
               so its workers' verdicts are not sent.

``submit`` sends each with its signatures (the one-shot auditor's, a persistent auditor's, or k
gathered from verdict files: audit.verdict_file) to the disputes contract; each one's outcome is
``upheld`` or the contract's named refusal (``DisputesWindowClosed``, ``DisputesAlreadyVoided``, …).
``dispute_findings`` is ``audit --dispute``: a fresh auditor admitted in-process (1 of 1), or the
persistent auditor of ``--auditor-dir`` (never admitted here), sending or only signing into
``--verdicts-out``. ``read_disputes`` is what every audit shows of a run: each upheld
verdict from the contract's ``VerdictUpheld`` events, with the party's worker id; ``unbacked_voids``
is what the audit checks of them (``tally``): the ledger voided exactly the credits upheld verdicts of
admitted auditors, inside their rounds' windows, void; ``unverified_auditors`` re-verifies each
admitted auditor's stored admission record and evidence (``auditor-evidence`` for the verdicts they signed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attestation.verdict import Verdict, check_id
from settlement import ChainError
from settlement.disputes import Disputes
from settlement.records import CreditVoided, RoundRecord, RunRecord, Tenures
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
# Replay rows that name the worker: an update that does not replay, and a committed state it did not
# reveal when challenged (audit.reveal). Either voids the worker's credit for the round, nothing else.
WORKER_ROW_CHECKS = {"MISMATCH": AuditCheck.REPLAY, "unrevealed": AuditCheck.REVEAL}


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


def verdicts_of(result: AuditResult, rounds: list[RoundRecord], holders: Tenures | str) -> list[Verdict]:
    """The verdicts the audit's failures support, one per (round, party), coordinator's first: a
    coordinator failure of a round is the verdict against the coordinator that held it (``holders``:
    settlement.records.Tenures, or the one coordinator of a run that never changed hands)."""
    if result.run_id is None:
        return []
    tenures = Tenures.coerce(holders)
    by_round = {record.round: record for record in rounds}
    verdicts: dict[tuple[int, str], Verdict] = {}
    for failure in result.failures:
        record = by_round.get(failure.round) if failure.round else None
        coordinator = tenures.at(record.round) if record is not None else ""
        if record is not None and failure.check in COORDINATOR_CHECKS and (record.round, coordinator) not in verdicts:
            verdicts[(record.round, coordinator)] = Verdict(result.run_id, record.round, coordinator, str(failure.check),
                                                            record.manifest_digest)
    voided = {r for r, _ in verdicts}
    roster = result.roster or Roster()
    rows = result.replay.rows if result.replay is not None else []
    for row in rows:
        record = by_round.get(row.round)
        address = roster.address_of(row.worker)
        check = WORKER_ROW_CHECKS.get(row.status)
        if check is None or record is None or address is None or row.round in voided:
            continue
        update = next((s.report.update_digest for s in record.reports if s.report.worker == address), None)
        if update is not None and (row.round, address) not in verdicts:
            verdicts[(row.round, address)] = Verdict(result.run_id, row.round, address, str(check), update)
    return sorted(verdicts.values(), key=lambda v: (v.round, v.party != tenures.at(v.round), v.party))


def submit(disputes: Disputes, verdicts: list[Verdict], rounds: list[RoundRecord],
           sign: Callable[[Verdict], list[bytes]], party_id: Callable[[str], str]) -> list[DisputeRow]:
    """Send each verdict with its signatures (``sign(verdict)``: one auditor's, or k gathered); its
    outcome as the contract says, a refusal by the contract's error name."""
    by_round = {record.round: record for record in rounds}
    rows = []
    for verdict in verdicts:
        record = by_round.get(verdict.round)
        if record is None:
            rows.append(DisputeRow(verdict, party_id(verdict.party), "refused: the round is not recorded"))
            continue
        try:
            receipt = disputes.dispute(verdict, record, sign(verdict))
        except ChainError as exc:
            rows.append(DisputeRow(verdict, party_id(verdict.party), f"refused: {exc}"[:300]))
            continue
        rows.append(DisputeRow(verdict, party_id(verdict.party), "upheld",
                               "0x" + bytes(receipt["transactionHash"]).hex()))
    return rows


def read_disputes(disputes: Disputes, run_id: bytes, holders: Tenures | str, roster: Roster | None) -> list[DisputeRow]:
    """Every upheld verdict of the run, oldest first, as the contract's events tell it."""
    label = labeller(holders, roster)
    rows = []
    for event in disputes.verdicts(run_id):
        verdict = Verdict(event.run_id, event.round, event.party, CHECK_NAMES.get(event.check, hex32(event.check, "check")),
                          event.evidence)
        rows.append(DisputeRow(verdict, label(event.party), "upheld", event.tx_hash, event.signers))
    return rows


def labeller(holders: Tenures | str, roster: Roster | None) -> Callable[[str], str]:
    """A party's name: "coordinator" for any coordinator the run has had, else its worker id."""
    roster, coordinators = roster or Roster(), Tenures.coerce(holders).coordinators
    return lambda address: "coordinator" if address in coordinators else roster.id_of(address)


@dataclass(frozen=True)
class DisputeOptions:
    """How ``dilocox audit --dispute`` disputes: the chain key that sends (the disputes contract's
    owner's in the one-shot flow, which verifies and admits a fresh auditor; None with
    ``verdicts_out``, which sends nothing), the auditor's attestation provider (``dev`` with its root
    directory, or ``tdx``), the persistent auditor's directory (``--auditor-dir``: attested there
    once, admitted separately, never admitted here), and ``--verdicts-out`` (sign only, into that file)."""

    owner_key: bytes | None
    provider: str
    dev_root_dir: str | None
    auditor_dir: str | None = None
    verdicts_out: str | None = None

    def __repr__(self) -> str:
        return (f"DisputeOptions(provider={self.provider!r}, dev_root_dir={self.dev_root_dir!r}, "
                f"auditor_dir={self.auditor_dir!r}, verdicts_out={self.verdicts_out!r}, owner_key=<hidden>)")


def dispute_findings(result: AuditResult, rpc_url: str, deployment: Deployment, store: Store, policy: Policy,
                     options: DisputeOptions) -> list[DisputeRow]:
    """Turn ``result``'s failures into verdicts and sign them: one-shot, with a fresh auditor key the
    owner admits here, then submitted; or with the persistent auditor of ``options.auditor_dir``
    (attested there first if it holds none), submitted, or only written to ``options.verdicts_out``
    for ``dilocox settle dispute`` to gather k of. Returns each one's outcome (none when nothing is
    disputable).

    @raise settlement.ChainError when the chain cannot be used; attestation errors (and
        audit.auditor.AuditorDirError) when the auditor cannot attest, be read or be admitted
    """
    from attestation import EvidenceProvider, open_provider
    from settlement import Chain, Ledger
    from storage_client import CID, Codec

    from .auditor import Auditor, admit
    from .verdict_file import write_verdicts

    if result.run_id is None:
        return []
    chain = Chain(rpc_url, options.owner_key or os.urandom(32))  # a sign-only auditor sends nothing
    ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
    run = ledger.run_of(result.run_id)
    address = ledger.disputes_address()
    if run is None or address is None:
        raise ChainError(f"the ledger {ledger.address} has no run 0x{result.run_id.hex()} or no disputes contract")
    disputes = Disputes(chain, address, from_block=deployment.deployed_block)
    rounds = ledger.recorded_rounds(result.run_id)
    tenures = ledger.tenures(result.run_id, run)
    verdicts = verdicts_of(result, rounds, tenures)
    config_cid = str(CID(Codec.JSON, run.config_digest))

    def provider() -> EvidenceProvider:
        return open_provider(options.provider, dev_root_dir=options.dev_root_dir)

    if options.auditor_dir is not None:
        auditor = Auditor.open(Path(options.auditor_dir), provider, result.run_id, config_cid)
        if not disputes.is_auditor(result.run_id, auditor.address):
            log.warning("dispute: auditor %s is not admitted to the run yet (dilocox settle admit-auditor): its "
                        "signatures count only once it is", auditor.address)
    elif not verdicts:
        auditor = None
    else:
        auditor = Auditor.attest(provider(), result.run_id, config_cid)
        admit(disputes, store, auditor, config_cid, policy)
    label = labeller(tenures, result.roster)
    if not verdicts or auditor is None:
        log.info("dispute: no failure of this audit names one round and one party; no verdict signed%s",
                 f" ({options.verdicts_out} not written)" if options.verdicts_out else "")
        return []
    if options.verdicts_out is not None:
        try:
            write_verdicts(Path(options.verdicts_out), disputes.domain(), auditor.address,
                           [(v, auditor.sign(v, disputes)) for v in verdicts])
        except OSError as exc:
            raise ValueError(f"--verdicts-out {options.verdicts_out}: cannot be written "
                             f"({exc.strerror or type(exc).__name__})") from None
        return [DisputeRow(v, label(v.party), f"signed into {options.verdicts_out}", signers=(auditor.address,))
                for v in verdicts]
    return submit(disputes, verdicts, rounds, lambda verdict: [auditor.sign(verdict, disputes)], label)


def unbacked_voids(disputes: Disputes, voided: list[CreditVoided], rounds: list[RoundRecord], run: RunRecord,
                   run_id: bytes, holders: Tenures | None = None) -> list[tuple[int, str, str]]:
    """(round, worker, why) for each credit the ledger's voids and the disputes contract's verdicts
    disagree on: a ``CreditVoided`` that no upheld verdict backs (one against the worker or the
    coordinator that held that round, ``holders``, by default the run's coordinator now; every signer
    admitted to the run by then, inside the round's window), and a credit an upheld verdict voids
    that the ledger still counts. The audit trusts neither
    contract's word alone: a ledger that voids an honest worker's credit, or keeps a cheat's, is named."""
    tenures = holders or Tenures.coerce(run.coordinator)
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
        parties = workers.get(verdict.round, ()) if verdict.party == tenures.at(verdict.round) else (verdict.party,)
        backed |= {(verdict.round, party) for party in parties}
    voids = {(v.round, v.worker) for v in voided}
    for round_, worker in sorted(voids - backed):
        problems.append((round_, worker, "the ledger voided its credit, but no upheld verdict backs that"))
    for round_, worker in sorted(backed - voids):
        problems.append((round_, worker, "an upheld verdict voids its credit, but the ledger still counts it"))
    return problems


def unverified_auditors(disputes: Disputes, store: Store, run_id: bytes, config_cid: str,
                        policy: Policy) -> tuple[dict[str, str], list[str]]:
    """Each auditor the disputes contract admitted to the run whose stored admission does not hold up,
    with why, and notes: its admission record (CID(JSON, evidenceDigest) on chain) and evidence are
    re-read from the store and verified under ``policy`` exactly as admission did (audit.admission:
    REPORTDATA binds the auditor, the run, the record's nonce and audit_code_measurement(config CID));
    dev evidence passes only under a policy that trusts its root (``--allow-dev``), and is said."""
    from attestation.measurement import audit_code_measurement

    from .admission import check_admission

    expected = {audit_code_measurement(config_cid)}
    bad: dict[str, str] = {}
    notes: list[str] = []
    for admission in disputes.admissions(run_id):
        checked = check_admission(store, worker=admission.auditor, measurement=admission.measurement,
                                  evidence_digest=admission.evidence_digest, run_id=run_id, policy=policy,
                                  code_measurements=expected)
        if not checked.ok:
            obj, check, message = checked.failures[0]
            bad[admission.auditor] = f"its admission does not hold up ({check} {obj}: {message})"[:400]
        elif checked.proves_nothing:
            notes.append(f"auditor {admission.auditor} was admitted on {checked.provider} evidence, which PROVES "
                         f"NOTHING")
    return bad, notes

"""What the audit reads of the coordinator's receipts (attestation.receipt, docs/trust.md "Receipts").

Two checks, both against the run's coordinator, never against the worker that holds the receipt:

  RECEIPT_FAULT     every ``ReceiptFaultProven`` of the run on the deployment's ReceiptCourt: a worker
                    proved on chain, with the coordinator's report receipt, that a recorded round left it
                    uncredited (settlement.receipt_court). Read from the chain alone.
  RECEIPT_WITHHELD  with ``dilocox audit --receipts DIR`` (workers' receipt folders): an update receipt,
                    signed by the run's coordinator (on chain), of an update that the receipted round's
                    manifest does not use (no participant names its digest): the coordinator counted the
                    update, said so, and left it out.

A withheld update is why a replay of the victim's later contributions cannot match the manifests (its
inner state moved through a round the manifests do not show): ``excused`` gives, per worker id, the
first round withheld from it, and the replay's call site (audit.recompute.check_replay) reports such a
mismatch as "the coordinator did not use what this worker sent" (RECEIPT_WITHHELD), not as "this
worker's update is wrong" (REPLAY).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attestation.receipt import ReceiptError, SignedReceipt
from attestation.report import Domain
from settlement import ChainError
from settlement.receipt_court import ReceiptCourt
from settlement.records import Tenures
from settlement.roster import Roster
from storage_client import CID, Manifest

from .checks import AuditCheck
from .findings import Findings


def check_receipt_faults(findings: Findings, court: ReceiptCourt | None, run_id: bytes) -> None:
    """Each fault proven on chain against the run's coordinator fails its round by name."""
    if court is None:
        return
    try:
        faults = court.faults(run_id)
    except (ChainError, ValueError) as exc:
        findings.fail(None, court.address, AuditCheck.RECEIPT_FAULT, f"the receipt court's events cannot be read: "
                                                                     f"{str(exc)[:200]}")
        return
    for fault in faults:
        findings.fail(fault.round, court.address, AuditCheck.RECEIPT_FAULT, fault.describe())


def check_update_receipts(findings: Findings, run_id: bytes, receipts: Iterable[SignedReceipt], domain: Domain,
                          holders: Tenures | str, manifests: Mapping[int, Manifest],
                          roster: Roster | None) -> dict[str, int]:
    """Fail the coordinator that held a round (``holders``: settlement.records.Tenures, or the one
    coordinator of a run that never changed hands) for each receipted update of the round its manifest
    does not use; returns the first such round per worker id (the victims the replay must not blame)."""
    tenures = Tenures.coerce(holders)
    excused: dict[str, int] = {}
    for signed in receipts:
        receipt = signed.receipt
        if receipt.run_id != run_id or receipt.reported or receipt.round not in manifests:
            continue  # a report receipt is proven on chain; an unrecorded round is not audited
        coordinator = tenures.at(receipt.round)
        try:
            if signed.signer(domain) != coordinator:
                continue  # not the word of the coordinator that held the round
        except ReceiptError:
            continue
        used = {CID.parse(p.update).digest for p in manifests[receipt.round].participants}
        if receipt.update_digest in used:
            continue
        worker = roster.label(receipt.worker) if roster is not None else receipt.worker
        findings.fail(receipt.round, "0x" + receipt.update_digest.hex(), AuditCheck.RECEIPT_WITHHELD,
                      f"the coordinator {coordinator} receipted {worker}'s update of round {receipt.round} and the "
                      f"round's manifest does not use it: the coordinator did not use what this worker sent")
        for worker_id in (roster.ids.get(receipt.worker, ()) if roster is not None else ()):
            excused[worker_id] = min(excused.get(worker_id, receipt.round), receipt.round)
    return excused

"""Every update that counts is signed by an admitted worker: each participant's push signatures.

A participant's update is averaged into the round whether or not its worker reports, and the
coordinator may list it as unreported (a worker that died between its push and its report). So
the report check (audit.report_checks) cannot be what proves that a worker sent it: the push can.
Each slice s of P was pushed with the worker's signature over

    u_s = attestation.signing.update_digest(runId, r, s, P, sha256(payload_s))

and its update record keeps that signature with the slice (trainer.runstore.update_record, v2).
For every participant of every recorded round, reported or not, ``push-signature`` checks:

    every slice has a signature, and all recover (recover(u_s, sig_s)) to one key K;
    K signed the report that names the update, where one does;
    otherwise (an unreported participant) K is checked as a report's signer is (audit.signers:
    admitted, not revoked, of an allowlisted measurement as of the recording block, on an admission
    whose record and evidence verify; those failures carry their own checks and name the push).

A ghost (an update no admitted key pushed), a signature that is missing (a record stored before
signatures were kept, schema v1: named, never a crash), forged, or by an unadmitted or revoked
key, fails by the participant's id. A record that cannot be read is audit.lineage's
``object`` / ``update-record`` failure already, and is not reported twice.
"""

from __future__ import annotations

from attestation import SignatureError, recover_address
from attestation.signing import update_digest
from settlement.records import RoundRecord
from storage_client import Manifest, Participant
from trainer.runstore.update_record import RecordError, SliceRef, parse_record

from .checks import AuditCheck
from .findings import Findings, cid_digest
from .signers import Signers


class PushSignatures:
    """Checks each recorded round's participants' push signatures (``check``)."""

    def __init__(self, findings: Findings, signers: Signers) -> None:
        self.findings = findings
        self.signers = signers

    def check(self, run_id: bytes, record: RoundRecord, manifest: Manifest) -> None:
        reporters = {signed.report.update_digest: signed.report.worker for signed in record.reports}
        listed: dict[str, str] = {}  # update -> the first participant listing it
        for p in manifest.participants:
            if p.update in listed:  # one push counted twice, under another worker id
                self.findings.fail(record.round, p.update, AuditCheck.PUSH_SIGNATURE,
                                   f"participant {p.worker}'s update is participant {listed[p.update]}'s too: one "
                                   f"push counts once")
                continue
            listed[p.update] = p.worker
            signer = self._signer(run_id, record.round, p)
            if signer is None:
                continue
            reporter = reporters.get(cid_digest(p.update))
            if reporter is None:  # on the coordinator's word alone: the push is all that vouches for it
                self.signers.check(run_id, record.round, f"the push of participant {p.worker} ({p.update})",
                                   signer, record.block)
            elif reporter != signer:
                self.findings.fail(record.round, p.update, AuditCheck.PUSH_SIGNATURE,
                                   f"participant {p.worker}'s update was pushed by {signer}, but its report is "
                                   f"signed by {reporter}")

    def _signer(self, run_id: bytes, r: int, p: Participant) -> str | None:
        """The one key that signed every slice of ``p``'s update, or None after a failure (or when
        the record cannot be read, which audit.lineage reports)."""
        try:
            refs = parse_record(self.findings.store.get(p.update))
        except (OSError, ValueError):  # StoreError and RecordError: lineage's object / update-record failure
            return None
        signers: set[str] = set()
        for ref in refs:
            signer = self._recovered(run_id, r, p, ref)
            if signer is None:
                return None
            signers.add(signer)
        if len(signers) != 1:
            self.findings.fail(r, p.update, AuditCheck.PUSH_SIGNATURE,
                               f"participant {p.worker}'s stage slices are signed by {len(signers)} different keys: "
                               + ", ".join(sorted(signers)))
            return None
        return signers.pop()

    def _recovered(self, run_id: bytes, r: int, p: Participant, ref: SliceRef) -> str | None:
        where = f"participant {p.worker}'s update" + (f" (stage {ref.stage} of {ref.num_stages})"
                                                       if ref.num_stages > 1 else "")
        if ref.signature is None:
            self.findings.fail(r, p.update, AuditCheck.PUSH_SIGNATURE,
                               f"{where} keeps no push signature (a record stored before signatures were kept, or "
                               f"one no worker signed): nothing shows an admitted worker sent it")
            return None
        try:
            digest = update_digest(run_id, r, ref.stage, ref.num_stages, ref.payload_sha256)
            return recover_address(digest, bytes.fromhex(ref.signature))
        except (SignatureError, RecordError, ValueError) as exc:
            self.findings.fail(r, p.update, AuditCheck.PUSH_SIGNATURE,
                               f"{where}'s push signature does not recover to a key: {str(exc)[:200]}")
            return None

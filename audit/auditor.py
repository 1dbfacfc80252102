"""An auditor as an attested party (docs/trust.md "Disputes"): its key, its evidence, its admission.

An auditor's secp256k1 key is made inside the process that audits, under its attestation provider
(the TDX provider, or the dev stand-in that PROVES NOTHING), exactly as a worker's is: its evidence
binds the key to the run and to the *audit code's* measurement through REPORTDATA

    REPORTDATA = sha256("dilocox/worker-key/v1" ‖ auditor address ‖ runId ‖ nonce) ‖ audit code measurement
    audit code measurement = attestation.audit_code_measurement(config CID)   (the worker's packages + audit/)

Admission (``admit``) is what the disputes contract's owner runs — the ledger's deployer, who owns the
worker registry, never the run's coordinator: it derives the expected REPORTDATA itself, verifies
the evidence under its policy, keeps the evidence and an admission record (attestation.admission,
the same record a worker's admission writes) in the run's store, and admits the key to the run with
the record's digest; it sets the run's threshold to 1 if none is set (the demo's 1 of 1). The key
never leaves the ``Auditor`` object: a verdict is signed in the process that attested.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from attestation import Evidence, EvidenceProvider, Policy, WorkerKey, attest, report_data, verify_evidence
from attestation.admission import admission_record
from attestation.measurement import audit_code_measurement
from attestation.verdict import Verdict
from settlement.disputes import Disputes
from storage_client import CID, Store

log = logging.getLogger("dilocox.audit")


@dataclass(frozen=True)
class Auditor:
    """An attested auditor key for one run: its key (kept here only), the nonce and evidence that bind it."""

    key: WorkerKey
    run_id: bytes
    nonce: bytes
    evidence: Evidence

    @property
    def address(self) -> str:
        return self.key.address

    @classmethod
    def attest(cls, provider: EvidenceProvider, run_id: bytes, config_cid: str) -> Auditor:
        """A fresh key, attested by ``provider`` as bound to ``run_id`` and the audit code's measurement."""
        key = WorkerKey.generate()
        nonce = os.urandom(32)
        evidence = attest(provider, key, run_id, nonce, audit_code_measurement(config_cid))
        return cls(key, run_id, nonce, evidence)

    def sign(self, verdict: Verdict, disputes: Disputes) -> bytes:
        """This auditor's signature over ``verdict`` in the disputes contract's domain."""
        return self.key.sign_digest(verdict.digest(disputes.domain()))


def admit(owner: Disputes, store: Store, auditor: Auditor, config_cid: str, policy: Policy) -> CID:
    """Verify ``auditor``'s evidence as the disputes contract's owner and admit its key to the run;
    returns the admission record's CID. A key admitted already is left as it is.

    @raise attestation.PolicyViolation when the evidence does not bind the key to the audit code
    @raise settlement.TxReverted naming the contract's refusal (not the owner, the run's coordinator, …)
    """
    run_id = auditor.run_id
    measurement = audit_code_measurement(config_cid)
    expected = report_data(auditor.address, run_id, auditor.nonce, measurement)
    verified = verify_evidence(auditor.evidence, expected_report_data=expected, policy=policy)
    evidence_cid = store.put(auditor.evidence.to_bytes())
    record = store.put_json(admission_record(worker=auditor.address, run_id=run_id, nonce=auditor.nonce,
                                             measurement=verified.measurement, code_measurement=measurement,
                                             provider=verified.provider, evidence=evidence_cid))
    if not owner.is_auditor(run_id, auditor.address):
        owner.admit_auditor(run_id, auditor.address, verified.measurement, record.digest)
        if owner.panel_of(run_id)[1] == 0:
            owner.set_threshold(run_id, 1)
    note = f" ({verified.provider.upper()} evidence: PROVES NOTHING)" if verified.proves_nothing else ""
    log.info("auditor %s admitted to run 0x%s…, record %s%s", auditor.address, run_id.hex()[:12], record, note)
    return record

"""Who signed: each report's signer as the registry saw it when the round was recorded.

Checks ``registry`` (the ledger consults the audited registry), and for each signer ``admitted``,
``revoked``, ``measurement-allowed`` and, once per admission, ``admission-record`` and ``evidence``
(audit.admission; a later report of a worker whose admission failed is an ``admission`` failure).

"As of the recording block" is the state after that whole block, rebuilt from the registry's
events (WorkerAdmitted, WorkerRevoked, MeasurementSet), never from the registry's current views
(audit.core says why).
"""

from __future__ import annotations

from collections import defaultdict

from attestation import Policy, checksum_address
from settlement import Ledger, Registry
from settlement.records import Admission, MeasurementChange, Revocation

from .admission import AdmissionCheck, check_admission
from .checks import AuditCheck
from .findings import Findings


class Signers:
    """The registry's history, read once (``read_history``), and the admissions checked so far."""

    def __init__(self, findings: Findings, registry: Registry, policy: Policy) -> None:
        self.findings = findings
        self.registry = registry
        self.policy = policy
        self.admissions: dict[str, list[Admission]] = defaultdict(list)
        self.revocations: dict[str, list[Revocation]] = defaultdict(list)
        self.measurement_events: list[MeasurementChange] = []
        # (worker, evidenceDigest) -> (the round it was first checked in, what checking it found)
        self._admission_checks: dict[tuple[str, bytes], tuple[int, AdmissionCheck]] = {}

    def check_consulted(self, ledger: Ledger) -> None:
        """The ledger consults the registry being audited (``registry``)."""
        consulted = checksum_address(ledger.registry_address())
        if consulted != checksum_address(self.registry.address):
            self.findings.fail(None, ledger.address, AuditCheck.REGISTRY,
                               f"the ledger consults registry {consulted}, not the audited {self.registry.address}")

    def read_history(self) -> None:
        """Every admission, revocation and allowlist change of the registry, in chain order."""
        for admission in self.registry.admissions():
            self.admissions[admission.worker].append(admission)
        for revocation in self.registry.revocations():
            self.revocations[revocation.worker].append(revocation)
        self.measurement_events = self.registry.measurement_changes()

    @property
    def dev_admitted(self) -> list[str]:
        """The signers admitted on evidence that proves nothing (dev) that the policy accepted, in the
        order first met."""
        return list(dict.fromkeys(worker for (worker, _), (_, c) in self._admission_checks.items()
                                  if c.proves_nothing and c.ok))

    def check(self, run_id: bytes, r: int, label: str, worker: str, block: int) -> None:
        """``worker``, who signed report ``label`` of round r, recorded at ``block``, was admitted, not
        revoked and of an allowlisted measurement then, on an admission whose record and evidence verify."""
        fail = self.findings.fail
        admitted = [a for a in self.admissions.get(worker, []) if a.block <= block]
        if not admitted:
            later = self.admissions.get(worker, [])
            when = f" (only later, at block {later[0].block})" if later else ""
            fail(r, label, AuditCheck.ADMITTED, f"{worker} was never admitted to registry {self.registry.address} before the "
                                       f"round was recorded at block {block}{when}")
            return
        admission = admitted[-1]
        revoked = [v for v in self.revocations.get(worker, []) if v.block <= block]
        if revoked:
            fail(r, label, AuditCheck.REVOKED,
                 f"{worker} was revoked at block {revoked[0].block}, and the round was recorded at block {block}")
        measurement = admission.measurement
        if not self._measurement_allowed(measurement, block):
            fail(r, label, AuditCheck.MEASUREMENT_ALLOWED,
                 f"{worker}'s measurement 0x{measurement.hex()} was not allowlisted at block {block}")
        self._check_admission(run_id, r, label, worker, measurement, admission.evidence_digest)

    def _check_admission(self, run_id: bytes, r: int, label: str, worker: str, measurement: bytes,
                         evidence_digest: bytes) -> None:
        # Each admission's record and evidence are verified once; a later report of the same worker
        # points back to the round whose failures describe them.
        key = (worker, evidence_digest)
        if key in self._admission_checks:
            first, checked = self._admission_checks[key]
            if not checked.ok:
                self.findings.fail(r, label, AuditCheck.ADMISSION,
                                   f"{worker}'s admission record or evidence did not verify (see round {first})")
            return
        checked = check_admission(self.findings.store, worker=worker, measurement=measurement,
                                  evidence_digest=evidence_digest, run_id=run_id, policy=self.policy)
        self._admission_checks[key] = (r, checked)
        for obj, check, message in checked.failures:
            self.findings.fail(r, obj, check, message)
        for warning in checked.warnings:
            self.findings.warn(warning)

    def _measurement_allowed(self, measurement: bytes, block: int) -> bool:
        allowed = False
        for event in self.measurement_events:
            if event.block > block:
                break
            if event.measurement == measurement:
                allowed = event.allowed
        return allowed

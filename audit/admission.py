"""From an on-chain admission to the evidence behind it (docs/trust.md "Admission").

``WorkerAdmitted(worker, measurement, evidenceDigest)`` names, through ``evidenceDigest``, the
admission record ``CID(JSON, evidenceDigest)`` in the store (attestation.admission):

    {"schema": "dilocox.admission/v2", "worker", "run_id", "nonce", "measurement",
     "code_measurement", "provider", "evidence": CID of the Evidence bytes (RAW)}

``check_admission`` re-reads the record and the evidence, and verifies the evidence against the
auditor's policy with the REPORTDATA the record implies:

    REPORTDATA = report_data(worker, record.run_id, record.nonce, code measurement)

The code measurement is never taken from the evidence (a quote's own REPORTDATA[32:64] would
only be compared with itself). It is the record's ``code_measurement``: the value the coordinator
computed with its own code, required of the worker, and committed on chain with the record's
digest. For dev evidence it must also equal the recorded (and on-chain) measurement, which for
dev *is* the code measurement (its verifier ``measures_code``: attestation.verifier); a v1 record,
which has no ``code_measurement``, is read for dev evidence with the recorded measurement in its
place and refused for tdx. When the auditor knows
which code measurements to expect (for instance ``code_measurement(config_cid)`` over the code it
audits), it passes them as ``code_measurements`` and the record's must be one of them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from attestation import (
    Evidence,
    EvidenceError,
    Policy,
    PolicyViolation,
    checksum_address,
    report_data,
    verifier_for,
    verify_evidence,
)
from attestation.admission import (
    ADMISSION_SCHEMA,
    ADMISSION_SCHEMA_V1,
    RECORD_KEYS,
    RECORD_KEYS_V1,
    admission_record_cid,
)
from storage_client import (
    CID,
    unhex32,
    Codec,
    CorruptObjectError,
    InvalidCIDError,
    MissingObjectError,
    Store,
    StoreError,
)

from .checks import AuditCheck

_KEYS_BY_SCHEMA = {ADMISSION_SCHEMA: RECORD_KEYS, ADMISSION_SCHEMA_V1: RECORD_KEYS_V1}


@dataclass
class AdmissionCheck:
    """What checking one admission found: failures as (object, check, message), and notes."""

    record: str
    failures: list[tuple[str, AuditCheck, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    provider: str | None = None
    proves_nothing: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, obj: str, check: AuditCheck, message: str) -> None:
        self.failures.append((obj, check, message))


@dataclass(frozen=True)
class _Record:
    """An admission record's fields, parsed. ``code`` is None in a v1 record."""

    worker: str
    provider: str
    run_id: bytes
    nonce: bytes
    measurement: bytes
    code: bytes | None
    evidence: CID


def check_admission(store: Store, *, worker: str, measurement: bytes, evidence_digest: bytes,
                    run_id: bytes, policy: Policy,
                    code_measurements: Collection[bytes] | None = None) -> AdmissionCheck:
    """Check one ``WorkerAdmitted`` event's record and evidence; never raises for bad data.

    `code_measurements`, when given, are the code measurements the auditor expects; the record's
    must be one of them (module docstring)."""
    record_cid = admission_record_cid(evidence_digest)
    result = AdmissionCheck(record=str(record_cid))
    record = _read_record(store, record_cid, worker, evidence_digest, result)
    if record is None or not _matches_chain(str(record_cid), record, worker, measurement, run_id, result):
        return result
    evidence = _read_evidence(store, record.evidence, worker, result)
    if evidence is None:
        return result
    result.provider = evidence.provider
    code = _code_measurement(record, evidence, str(record_cid), worker, code_measurements, result)
    if code is not None:
        _verify(evidence, record, code, worker, measurement, policy, result)
    return result


def _read_record(store: Store, record_cid: CID, worker: str, evidence_digest: bytes,
                 result: AdmissionCheck) -> _Record | None:
    """The admission record, read and parsed; None after an ``admission-record`` failure."""
    obj_name = str(record_cid)
    try:
        record = store.get_json(record_cid)
    except MissingObjectError:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"the admission record of {worker} (evidenceDigest 0x{evidence_digest.hex()}) is not in the store")
        return None
    except CorruptObjectError as exc:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD, f"the admission record of {worker} is corrupt: {exc}")
        return None
    except StoreError as exc:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD, f"the admission record of {worker} is unreadable: {exc}")
        return None

    schema = record.get("schema") if isinstance(record, dict) else None
    if not isinstance(schema, str) or schema not in _KEYS_BY_SCHEMA:
        schema = schema if isinstance(record, dict) else type(record).__name__
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"not an admission record: schema {str(schema)[:60]!r}, expected {ADMISSION_SCHEMA!r}")
        return None
    expected_keys = _KEYS_BY_SCHEMA[record["schema"]]
    if set(record) != expected_keys:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"not a {record['schema']} record: keys {sorted(str(k)[:40] for k in record)[:12]}, "
                    f"expected {sorted(expected_keys)}")
        return None
    try:
        field = {k: unhex32(record[k], f"field {k}")
                 for k in ("run_id", "nonce", "measurement", "code_measurement") if k in record}
        return _Record(worker=checksum_address(record["worker"]), provider=record["provider"],
                       run_id=field["run_id"], nonce=field["nonce"], measurement=field["measurement"],
                       code=field.get("code_measurement"), evidence=CID.parse(record["evidence"]))
    except (KeyError, ValueError, TypeError, InvalidCIDError) as exc:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD, f"malformed admission record: {exc}")
        return None


def _matches_chain(obj_name: str, record: _Record, worker: str, measurement: bytes, run_id: bytes,
                   result: AdmissionCheck) -> bool:
    """The record names the worker and the measurement the chain admitted; a record of another run
    is a warning. False when its evidence is not a RAW object, so there is no evidence to read."""
    if record.worker != worker:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"the record names worker {record.worker}, but the chain admitted {worker} with it")
    if record.measurement != measurement:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"the record says measurement 0x{record.measurement.hex()}, the chain 0x{measurement.hex()}")
    if record.run_id != run_id:
        result.warnings.append(
            f"worker {worker} was admitted with evidence for run 0x{record.run_id.hex()}, not the audited run "
            f"0x{run_id.hex()} (its key was active already; the registry is shared between runs)")
    if record.evidence.codec != Codec.RAW:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD, f"evidence CID {record.evidence} is not a RAW object")
        return False
    return True


def _read_evidence(store: Store, evidence_cid: CID, worker: str, result: AdmissionCheck) -> Evidence | None:
    """The evidence the record names, parsed; None after an ``evidence`` failure."""
    try:
        evidence_bytes = store.get(evidence_cid)
    except MissingObjectError:
        result.fail(str(evidence_cid), AuditCheck.EVIDENCE, f"the evidence of {worker} is not in the store")
        return None
    except CorruptObjectError as exc:
        result.fail(str(evidence_cid), AuditCheck.EVIDENCE, f"the evidence of {worker} is corrupt: {exc}")
        return None
    try:
        return Evidence.from_bytes(evidence_bytes)
    except EvidenceError as exc:
        result.fail(str(evidence_cid), AuditCheck.EVIDENCE, f"the evidence of {worker} is malformed: {exc}")
        return None


def _code_measurement(record: _Record, evidence: Evidence, obj_name: str, worker: str,
                      code_measurements: Collection[bytes] | None, result: AdmissionCheck) -> bytes | None:
    """The code measurement the evidence's REPORTDATA must bind (module docstring), after checking
    that the record agrees with the evidence and the auditor; None when a v1 record cannot say it."""
    if record.provider != evidence.provider:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"the record says provider {record.provider!r}, the evidence is {evidence.provider!r}")
    measures_code = verifier_for(evidence.provider).measures_code  # dev: its measurement is the code's
    if record.code is None:  # a v1 record
        if not measures_code:
            result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                        f"the {ADMISSION_SCHEMA_V1} record of {worker} does not say which code measurement the "
                        f"coordinator required, and the quote's own REPORTDATA[32:64] proves nothing")
            return None
        code = record.measurement
    else:
        code = record.code
        if measures_code and code != record.measurement:
            result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                        f"the record's code measurement 0x{code.hex()} is not its {evidence.provider} measurement "
                        f"0x{record.measurement.hex()}")
    if code_measurements is not None and code not in {bytes(c) for c in code_measurements}:
        result.fail(obj_name, AuditCheck.ADMISSION_RECORD,
                    f"the record's code measurement 0x{code.hex()} is not one the auditor expects "
                    f"({', '.join('0x' + bytes(c).hex()[:16] + '…' for c in code_measurements) or 'none'})")
    return code


def _verify(evidence: Evidence, record: _Record, code: bytes, worker: str, measurement: bytes, policy: Policy,
            result: AdmissionCheck) -> None:
    """The evidence passes the auditor's policy with the REPORTDATA the record implies, and measures
    what the chain admitted."""
    evidence_name = str(record.evidence)
    try:
        expected = report_data(worker, record.run_id, record.nonce, code)
        verified = verify_evidence(evidence, expected_report_data=expected, policy=policy, log_acceptance=False)
    except PolicyViolation as exc:
        hint = " (pass --allow-dev to accept dev evidence, which proves nothing)" if exc.check == "provider" else ""
        result.fail(evidence_name, AuditCheck.EVIDENCE, f"evidence of {worker} refused by the policy: {exc}{hint}")
        return
    except (ValueError, EvidenceError) as exc:
        result.fail(evidence_name, AuditCheck.EVIDENCE, f"evidence of {worker} cannot be verified: {exc}")
        return
    if verified.measurement != measurement:
        result.fail(evidence_name, AuditCheck.EVIDENCE,
                    f"the evidence measures 0x{verified.measurement.hex()}, but {worker} was admitted with "
                    f"0x{measurement.hex()}")
    result.proves_nothing = verified.proves_nothing  # said once for the run by the audit (audit.core)

"""The admission record: what a verifier checked when it let a worker key into a run.

Stored as a canonical-JSON object; the sha256 inside its CID is the ``evidenceDigest`` the
registry records, so an auditor goes chain → record → evidence → REPORTDATA (docs/trust.md):

    {"schema": "dilocox.admission/v2", "worker": address, "run_id": "0x…", "nonce": "0x…",
     "measurement": "0x…", "code_measurement": "0x…", "provider": "dev"|"tdx",
     "evidence": CID of the Evidence bytes (RAW)}

``code_measurement`` is the code measurement the verifier computed itself
(``code_measurement(config_cid)`` over its own code) and required REPORTDATA[32:64] to equal; it is
never read out of the evidence. For dev evidence it equals ``measurement``. Version 1 records
(``dilocox.admission/v1``) lack it; auditors still read them for dev evidence, where the
measurement is the code measurement.
"""

from __future__ import annotations

from typing import Any

from storage_client import CID, Codec, hex32

ADMISSION_SCHEMA = "dilocox.admission/v2"
ADMISSION_SCHEMA_V1 = "dilocox.admission/v1"
RECORD_KEYS_V1 = frozenset({"schema", "worker", "run_id", "nonce", "measurement", "provider", "evidence"})
RECORD_KEYS = RECORD_KEYS_V1 | {"code_measurement"}


def admission_record(*, worker: str, run_id: bytes, nonce: bytes, measurement: bytes,
                     code_measurement: bytes, provider: str, evidence: CID) -> dict[str, Any]:
    """The record of one admission. `code_measurement` is the verifier's own (the value it put into
    the expected REPORTDATA), `measurement` the allowlisted one that verification returned."""
    return {
        "schema": ADMISSION_SCHEMA, "worker": worker, "run_id": hex32(run_id, "run_id"),
        "nonce": hex32(nonce, "nonce"), "measurement": hex32(measurement, "measurement"),
        "code_measurement": hex32(code_measurement, "code_measurement"), "provider": provider,
        "evidence": str(evidence),
    }


def admission_record_cid(evidence_digest: bytes) -> CID:
    """The store object an on-chain ``evidenceDigest`` names."""
    return CID(Codec.JSON, evidence_digest)

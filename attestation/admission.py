"""The admission record: what a verifier checked when it let a worker key into a run.

Stored as a canonical-JSON object; the sha256 inside its CID is the ``evidenceDigest`` the
registry records, so an auditor goes chain → record → evidence → REPORTDATA (docs/trust.md).
"""

from __future__ import annotations

from typing import Any

from storage_client import CID, Codec

ADMISSION_SCHEMA = "dilocox.admission/v1"


def admission_record(*, worker: str, run_id: bytes, nonce: bytes, measurement: bytes, provider: str,
                     evidence: CID) -> dict[str, Any]:
    return {
        "schema": ADMISSION_SCHEMA, "worker": worker, "run_id": "0x" + run_id.hex(),
        "nonce": "0x" + nonce.hex(), "measurement": "0x" + measurement.hex(), "provider": provider,
        "evidence": str(evidence),
    }


def admission_record_cid(evidence_digest: bytes) -> CID:
    """The store object an on-chain ``evidenceDigest`` names."""
    return CID(Codec.JSON, evidence_digest)

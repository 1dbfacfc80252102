"""attestation.verifier: a third TEE is one verifier class plus one registration, nothing else.

`ToyVerifier` below is a provider the product has never heard of ("toy"): its quote is
``b"TOY1" || REPORTDATA (64) || measurement (32) || flags (1, bit 0 = debug) || HMAC-SHA256(vendor
key, everything before) (32)``, its "signature chain" the HMAC under a vendor key it holds. Once
registered, evidence naming it is parsed, stored, verified and audited through the same calls as
tdx and dev evidence, and the checks every provider shares (allow_dev, REPORTDATA, debug,
allowlist) are applied to its claim by policy.verify_evidence without it doing anything for them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from attestation import (
    Evidence,
    EvidenceError,
    Expected,
    Policy,
    PolicyViolation,
    VerifiedEvidence,
    WorkerKey,
    register_verifier,
    registered_providers,
    report_data,
    unregister_verifier,
    verifier_for,
    verify_evidence,
)
from attestation.admission import admission_record
from attestation.evidence import check_dev_signature
from audit.admission import check_admission
from storage_client import ObjectStore

RUN = hashlib.sha256(b"run").digest()
NONCE = hashlib.sha256(b"nonce").digest()
CODE = hashlib.sha256(b"code").digest()
HARDWARE = hashlib.sha256(b"toy hardware measurement").digest()
MAGIC = b"TOY1"
QUOTE_SIZE = len(MAGIC) + 64 + 32 + 1 + 32


class ToyVerifier:
    """The whole of a new provider: the one file a new TEE adds (module docstring)."""

    name = "toy"
    proves_nothing = False
    measures_code = False
    carries_dev_signature = False

    def __init__(self, vendor_key: bytes) -> None:
        self.vendor_key = vendor_key
        self.verified = 0

    def canonical_quote(self, evidence: Evidence) -> bytes:
        quote = bytes(evidence.quote)
        if len(quote) != QUOTE_SIZE or not quote.startswith(MAGIC):
            raise EvidenceError(f"toy quote must be {QUOTE_SIZE} bytes starting {MAGIC!r}")
        check_dev_signature(evidence, carried=False)
        return quote

    def verify(self, evidence: Evidence, expected: Expected, policy: Policy) -> VerifiedEvidence:
        body, mac = evidence.quote[:-32], evidence.quote[-32:]
        if not hmac.compare_digest(mac, hmac.new(self.vendor_key, body, hashlib.sha256).digest()):
            raise PolicyViolation("signature", "toy quote is not signed by the toy vendor key")
        self.verified += 1
        rd, measurement, flags = body[4:68], body[68:100], body[100]
        return VerifiedEvidence(provider=self.name, measurement=measurement, report_data=rd, debug=bool(flags & 1),
                                proves_nothing=False, label="toy quote verified by its vendor key",
                                details={"report_data": rd.hex()})

    def acceptance(self, verified: VerifiedEvidence) -> str:
        return "accepted toy evidence"


def toy_quote(vendor_key: bytes, rd: bytes, *, measurement: bytes = HARDWARE, debug: bool = False) -> bytes:
    body = MAGIC + rd + measurement + bytes([int(debug)])
    return body + hmac.new(vendor_key, body, hashlib.sha256).digest()


@pytest.fixture
def toy() -> Iterator[ToyVerifier]:
    verifier = ToyVerifier(os.urandom(32))
    register_verifier(verifier)  # the one registration line
    try:
        yield verifier
    finally:
        unregister_verifier("toy")


@pytest.fixture
def key() -> WorkerKey:
    return WorkerKey.generate()


def test_unregistered_provider_is_refused_by_name() -> None:
    assert registered_providers() == ("tdx", "dev")
    with pytest.raises(EvidenceError, match=r"unknown evidence provider 'toy'; known: \('tdx', 'dev'\)"):
        Evidence("toy", toy_quote(bytes(32), bytes(64)))
    record = b'{"provider":"toy","quote":"00","schema":"dilocox.evidence/v1"}'
    with pytest.raises(EvidenceError, match="unknown evidence provider 'toy'"):
        Evidence.from_bytes(record)


def test_registered_provider_is_picked_by_name(toy: ToyVerifier, key: WorkerKey) -> None:
    assert verifier_for("toy") is toy and registered_providers() == ("tdx", "dev", "toy")
    with pytest.raises(ValueError, match="registered already"):
        register_verifier(ToyVerifier(bytes(32)))
    rd = report_data(key.address, RUN, NONCE, CODE)
    evidence = Evidence("toy", toy_quote(toy.vendor_key, rd))
    wire = evidence.to_bytes()
    assert wire == b'{"provider":"toy","quote":"' + evidence.quote.hex().encode() + b'","schema":"dilocox.evidence/v1"}'
    assert Evidence.from_bytes(wire) == evidence
    verified = verify_evidence(wire, expected_report_data=rd,
                               policy=Policy(allowed_measurements=frozenset({HARDWARE})))
    assert toy.verified == 1
    assert (verified.provider, verified.measurement, verified.proves_nothing) == ("toy", HARDWARE, False)
    assert verified.label == "toy quote verified by its vendor key"


def test_shared_checks_apply_to_a_new_provider(toy: ToyVerifier, key: WorkerKey) -> None:
    rd = report_data(key.address, RUN, NONCE, CODE)
    policy = Policy(allowed_measurements=frozenset({HARDWARE}))

    def refusal(quote: bytes, expected: bytes = rd, policy: Policy = policy) -> str:
        with pytest.raises(PolicyViolation) as exc:
            verify_evidence(Evidence("toy", quote), expected_report_data=expected, policy=policy)
        return exc.value.check

    assert refusal(toy_quote(os.urandom(32), rd)) == "signature"  # the provider's own check
    assert refusal(toy_quote(toy.vendor_key, rd), expected=report_data(key.address, RUN, bytes(32), CODE)) == "report_data"
    assert refusal(toy_quote(toy.vendor_key, rd, debug=True)) == "debug"
    assert refusal(toy_quote(toy.vendor_key, rd, measurement=bytes(32))) == "measurement"
    assert verify_evidence(Evidence("toy", toy_quote(toy.vendor_key, rd, debug=True)), expected_report_data=rd,
                           policy=Policy(allow_debug=True)).debug
    with pytest.raises(EvidenceError, match="toy evidence must not carry a dev_signature"):
        Evidence("toy", toy_quote(toy.vendor_key, rd), dev_signature=bytes(65))
    with pytest.raises(EvidenceError, match="toy quote must be"):
        Evidence("toy", b"TOY1")


def test_audit_rechecks_a_new_providers_admission(toy: ToyVerifier, key: WorkerKey, tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    evidence = Evidence("toy", toy_quote(toy.vendor_key, report_data(key.address, RUN, NONCE, CODE)))
    record = store.put_json(admission_record(
        worker=key.address, run_id=RUN, nonce=NONCE, measurement=HARDWARE, code_measurement=CODE,
        provider="toy", evidence=store.put(evidence.to_bytes())))

    def check(policy: Policy, measurement: bytes = HARDWARE):
        return check_admission(store, worker=key.address, measurement=measurement, evidence_digest=record.digest,
                               run_id=RUN, policy=policy, code_measurements={CODE})

    result = check(Policy())
    assert result.ok and result.provider == "toy" and not result.proves_nothing, result.failures
    wrong = check(Policy(), measurement=bytes(32))
    assert not wrong.ok and "measurement" in wrong.failures[0][2]

"""audit.admission: from an on-chain admission to the record and the evidence, without a chain."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import audit.admission
from attestation import (
    DevProvider,
    DevRoot,
    Evidence,
    Policy,
    WorkerKey,
    attest,
    build_quote_v4,
    report_data,
)
from attestation.admission import ADMISSION_SCHEMA_V1, admission_record
from audit.admission import ADMISSION_SCHEMA, admission_record_cid, check_admission
from storage_client import CID, ObjectStore

RUN = hashlib.sha256(b"run").digest()
MEASUREMENT = hashlib.sha256(b"code").digest()


class Admitted:
    """A worker admitted the way the coordinator admits one (docs/trust.md "Admission")."""

    def __init__(self, tmp_path: Path, **record_overrides: object) -> None:
        self.store = ObjectStore(tmp_path / "store")
        self.root = DevRoot.load_or_create(tmp_path / "dev-root")
        self.key = WorkerKey.generate()
        self.nonce = os.urandom(32)
        evidence = attest(DevProvider(self.root), self.key, RUN, self.nonce, MEASUREMENT)
        self.evidence_cid = self.store.put(evidence.to_bytes())
        record = admission_record(worker=self.key.address, run_id=RUN, nonce=self.nonce, measurement=MEASUREMENT,
                                  code_measurement=MEASUREMENT, provider="dev", evidence=self.evidence_cid)
        assert record == {"schema": ADMISSION_SCHEMA, "worker": self.key.address, "run_id": "0x" + RUN.hex(),
                          "nonce": "0x" + self.nonce.hex(), "measurement": "0x" + MEASUREMENT.hex(),
                          "code_measurement": "0x" + MEASUREMENT.hex(), "provider": "dev",
                          "evidence": str(self.evidence_cid)}
        record.update(record_overrides)
        record = {k: v for k, v in record.items() if v is not None}  # an override of None removes the key
        self.record_cid = self.store.put_json(record)

    def check(self, policy: Policy | None = None, *, worker: str | None = None, measurement: bytes = MEASUREMENT,
              run_id: bytes = RUN, code_measurements: frozenset[bytes] | None = None):
        return check_admission(self.store, worker=worker or self.key.address, measurement=measurement,
                               evidence_digest=self.record_cid.digest, run_id=run_id,
                               policy=policy or Policy.development(self.root.address),
                               code_measurements=code_measurements)


def only(result) -> tuple[str, str, str]:
    assert len(result.failures) == 1, result.failures
    return result.failures[0]


def test_dev_admission_verifies_and_says_it_proves_nothing(tmp_path: Path) -> None:
    result = Admitted(tmp_path).check()
    assert result.ok and result.provider == "dev" and result.proves_nothing
    assert result.proves_nothing  # the audit says it once for the run, naming every such worker (audit.core)


def test_dev_evidence_refused_without_allow_dev(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    obj, check, message = only(admitted.check(Policy()))
    assert (obj, check) == (str(admitted.evidence_cid), "evidence")
    assert "provider" in message and "--allow-dev" in message


def test_untrusted_dev_root(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    _, check, message = only(admitted.check(Policy.development(DevRoot(os.urandom(32)).address)))
    assert check == "evidence" and "not a trusted dev root" in message


def test_missing_record_and_missing_evidence(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    admitted.store.path_of(admitted.evidence_cid).unlink()
    obj, check, message = only(admitted.check())
    assert (obj, check) == (str(admitted.evidence_cid), "evidence") and "not in the store" in message

    admitted.store.path_of(admitted.record_cid).unlink()
    obj, check, _ = only(admitted.check())
    assert (obj, check) == (str(admitted.record_cid), "admission-record")
    assert admission_record_cid(admitted.record_cid.digest) == admitted.record_cid


def test_corrupt_record(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    path = admitted.store.path_of(admitted.record_cid)
    path.write_bytes(path.read_bytes().replace(b"dev", b"tdx"))
    _, check, message = only(admitted.check())
    assert check == "admission-record" and "corrupt" in message


def test_record_must_name_the_admitted_worker_and_measurement(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    other = WorkerKey.generate().address
    failures = admitted.check(worker=other).failures
    assert any(c == "admission-record" and "names worker" in m for _, c, m in failures)
    assert any(c == "evidence" and "REPORTDATA" in m for _, c, m in failures)  # the evidence binds the other key

    failures = admitted.check(measurement=hashlib.sha256(b"other code").digest()).failures
    assert {c for _, c, _ in failures} == {"admission-record", "evidence"}


def test_evidence_must_bind_the_recorded_nonce(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path, nonce="0x" + os.urandom(32).hex())
    _, check, message = only(admitted.check())
    assert check == "evidence" and "report_data" in message


def test_evidence_for_another_run_is_a_warning(tmp_path: Path) -> None:
    result = Admitted(tmp_path).check(run_id=hashlib.sha256(b"a later run").digest())
    assert result.ok
    assert any("not the audited run" in w for w in result.warnings)


@pytest.mark.parametrize("field,value", [("schema", "dilocox.admission/v0"), ("evidence", "not a cid"),
                                         ("nonce", "0x1234")])
def test_malformed_records(tmp_path: Path, field: str, value: str) -> None:
    _, check, _ = only(Admitted(tmp_path, **{field: value}).check())
    assert check == "admission-record"


def test_evidence_must_be_a_raw_object(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    json_cid = CID(admitted.record_cid.codec, admitted.evidence_cid.digest)
    _, check, message = only(Admitted(tmp_path / "b", evidence=str(json_cid)).check())
    assert check == "admission-record" and "RAW" in message


def test_v1_dev_record_is_still_read_with_the_measurement_as_code(tmp_path: Path) -> None:
    result = Admitted(tmp_path, schema=ADMISSION_SCHEMA_V1, code_measurement=None).check()
    assert result.ok and result.proves_nothing


def test_record_keys_must_match_its_schema(tmp_path: Path) -> None:
    _, check, message = only(Admitted(tmp_path, code_measurement=None).check())  # v2 without the field
    assert check == "admission-record" and "keys" in message
    _, check, message = only(Admitted(tmp_path / "b", schema=ADMISSION_SCHEMA_V1).check())  # v1 with it
    assert check == "admission-record" and "keys" in message
    _, check, message = only(Admitted(tmp_path / "c", schema=["not", "a", "string"]).check())
    assert check == "admission-record" and "not an admission record" in message


def test_dev_record_code_measurement_must_be_its_measurement(tmp_path: Path) -> None:
    other = hashlib.sha256(b"other code").digest()
    failures = Admitted(tmp_path, code_measurement="0x" + other.hex()).check().failures
    assert any(c == "admission-record" and "is not its dev measurement" in m for _, c, m in failures)
    assert any(c == "evidence" and "report_data" in m for _, c, m in failures)  # REPORTDATA binds MEASUREMENT


def test_auditor_expected_code_measurements(tmp_path: Path) -> None:
    admitted = Admitted(tmp_path)
    assert admitted.check(code_measurements=frozenset({MEASUREMENT})).ok
    _, check, message = only(admitted.check(code_measurements=frozenset({hashlib.sha256(b"audited").digest()})))
    assert check == "admission-record" and "not one the auditor expects" in message


class TdxAdmitted:
    """A tdx admission: the quote is laid out correctly but carries no Intel signature chain."""

    def __init__(self, tmp_path: Path, *, schema: str = ADMISSION_SCHEMA) -> None:
        self.store = ObjectStore(tmp_path / "store")
        self.key = WorkerKey.generate()
        self.nonce = os.urandom(32)
        self.code = hashlib.sha256(b"the coordinator's code measurement").digest()
        claimed = hashlib.sha256(b"what the quote claims").digest()  # != self.code
        quote = build_quote_v4(report_data=report_data(self.key.address, RUN, self.nonce, claimed),
                               qe_vendor_id=bytes(range(16)), signature_data=b"no signature chain")
        self.evidence_cid = self.store.put(Evidence("tdx", quote).to_bytes())
        record = admission_record(worker=self.key.address, run_id=RUN, nonce=self.nonce, measurement=MEASUREMENT,
                                  code_measurement=self.code, provider="tdx", evidence=self.evidence_cid)
        if schema == ADMISSION_SCHEMA_V1:
            record = {**{k: v for k, v in record.items() if k != "code_measurement"}, "schema": schema}
        self.record_cid = self.store.put_json(record)

    def check(self, policy: Policy | None = None):
        return check_admission(self.store, worker=self.key.address, measurement=MEASUREMENT,
                               evidence_digest=self.record_cid.digest, run_id=RUN, policy=policy or Policy())


def test_tdx_admission_is_checked_against_the_records_code_measurement(tmp_path: Path, monkeypatch) -> None:
    """The expected REPORTDATA uses the code measurement the coordinator recorded, never the one the
    quote claims (a quote compared with itself proves nothing)."""
    admitted = TdxAdmitted(tmp_path)
    seen = []
    real = audit.admission.verify_evidence

    def spy(evidence, *, expected_report_data, policy, **options):
        seen.append(expected_report_data)
        return real(evidence, expected_report_data=expected_report_data, policy=policy, **options)

    monkeypatch.setattr(audit.admission, "verify_evidence", spy)
    result = admitted.check()
    assert seen == [report_data(admitted.key.address, RUN, admitted.nonce, admitted.code)]
    obj, check, message = only(result)
    assert (obj, check) == (str(admitted.evidence_cid), "evidence")
    assert "dcap" in message and "no DCAP collateral is configured" in message  # never admitted unverified
    assert not result.proves_nothing


def test_v1_tdx_record_is_refused(tmp_path: Path) -> None:
    _, check, message = only(TdxAdmitted(tmp_path, schema=ADMISSION_SCHEMA_V1).check())
    assert check == "admission-record" and "does not say which code measurement" in message


def test_audit_cli_dcap_options(tmp_path: Path) -> None:
    import argparse

    from attestation import DcapSettings
    from audit.cli import add_arguments, dcap_settings, policy_for, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--run", str(tmp_path), "--dcap-collateral", "c.json",
                              "--allow-tcb-status", "SWHardeningNeeded"])
    dcap = dcap_settings(args.dcap_collateral, args.pccs_url, args.allow_tcb_status)
    assert dcap == DcapSettings(collateral_file=Path("c.json"),
                                allowed_tcb_statuses=frozenset({"UpToDate", "SWHardeningNeeded"}))
    assert policy_for(tmp_path, False, (), dcap)[0].dcap == dcap
    assert policy_for(tmp_path, True, (), dcap)[0].dcap == dcap
    assert dcap_settings(None, "https://pccs.example", []).pccs_url == "https://pccs.example"
    assert dcap_settings(None, None).source is None  # TDX evidence will be refused
    for bad in (["--allow-tcb-status", "Revoked"], ["--dcap-collateral", "c.json", "--pccs-url", "https://p"]):
        assert run(parser.parse_args(["--run", str(tmp_path), *bad])) == 2


"""audit.admission: from an on-chain admission to the record and the evidence, without a chain."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from attestation import DevProvider, DevRoot, Policy, WorkerKey, attest
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
        record = {"schema": ADMISSION_SCHEMA, "worker": self.key.address, "run_id": "0x" + RUN.hex(),
                  "nonce": "0x" + self.nonce.hex(), "measurement": "0x" + MEASUREMENT.hex(), "provider": "dev",
                  "evidence": str(self.evidence_cid)}
        record.update(record_overrides)
        self.record_cid = self.store.put_json(record)

    def check(self, policy: Policy | None = None, *, worker: str | None = None, measurement: bytes = MEASUREMENT,
              run_id: bytes = RUN):
        return check_admission(self.store, worker=worker or self.key.address, measurement=measurement,
                               evidence_digest=self.record_cid.digest, run_id=run_id,
                               policy=policy or Policy.development(self.root.address))


def only(result) -> tuple[str, str, str]:
    assert len(result.failures) == 1, result.failures
    return result.failures[0]


def test_dev_admission_verifies_and_says_it_proves_nothing(tmp_path: Path) -> None:
    result = Admitted(tmp_path).check()
    assert result.ok and result.provider == "dev" and result.proves_nothing
    assert any("PROVES NOTHING" in w for w in result.warnings)


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
